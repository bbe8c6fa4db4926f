"""The server's declared settings (``sgl_pic.binding.settings``): validation messages as
they were before the declarations (f33133e), every field but ``config`` declared."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import pytest

from sgl_pic.binding.settings import SERVER_SETTINGS, PicServerSettings
from sgl_pic.config import PicConfig
from sgl_pic.declare import Override


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"device_cache_fraction": 1.5}, "device_cache_fraction must be in [0, 1], got 1.5"),
        ({"device_cache_fraction": -0.1}, "device_cache_fraction must be in [0, 1], got -0.1"),
        ({"host_cache_mb": -1}, "host_cache_mb and disk_cache_mb must be >= 0"),
        ({"disk_cache_mb": -1}, "host_cache_mb and disk_cache_mb must be >= 0"),
        ({"eviction": "mru"}, "unknown eviction policy 'mru'; valid: lru, lfu, gdsf"),
        (
            {"admission": "never"},
            "unknown admission mode 'never'; valid: always, second_sight, adaptive",
        ),
        ({"feed_mode": "cuda"}, "unknown feed_mode 'cuda'; valid: threaded, inorder"),
        ({"feed_timeout_s": 0}, "feed_timeout_s must be in (0, 3600], got 0"),
        ({"feed_timeout_s": 4000}, "feed_timeout_s must be in (0, 3600], got 4000"),
        ({"merge_gap": -1}, "merge_gap must be an int in [0, 4096], got -1"),
        ({"merge_gap": True}, "merge_gap must be an int in [0, 4096], got True"),
        ({"merge_gap": 5000}, "merge_gap must be an int in [0, 4096], got 5000"),
        ({"max_body_mb": 0}, "max_body_mb must be >= 1 and max_json_depth >= 4"),
        ({"max_json_depth": 3}, "max_body_mb must be >= 1 and max_json_depth >= 4"),
        (
            {"shared_store": "redis://h:1"},
            "shared store URL 'redis://h:1': scheme must be one of mooncake",
        ),
        (
            {"shared_store": "mooncake://host"},
            "shared store URL 'mooncake://host' needs a host and a port",
        ),
        ({"auto_chunk": 5}, "auto_chunk must be a comma list of roles, got 5"),
        (
            {"auto_chunk": "tool,bogus"},
            "auto_chunk: 'bogus' is not a role auto-chunking knows; use a comma list of system, "
            "developer, user, assistant, tool, document ('' turns it off)",
        ),
        (
            {"public_namespaces": ["corpus"]},
            "public_namespaces must be a comma list of names, got ['corpus']",
        ),
        (
            {"namespace_device_fraction": 1.5},
            "namespace_device_fraction must be in [0, 1], got 1.5",
        ),
        ({"namespace_host_mb": -1}, "namespace_host_mb must be an int >= 0, got -1"),
        ({"namespace_disk_mb": 1.5}, "namespace_disk_mb must be an int >= 0, got 1.5"),
        ({"namespace_metrics": -2}, "namespace_metrics must be an int >= 0, got -2"),
        ({"namespace_metrics": True}, "namespace_metrics must be an int >= 0, got True"),
        (
            {"calibrate": True, "host_cache_mb": 0, "disk_cache_dir": ""},
            "calibration picks r per host/disk tier: enable one of them",
        ),
    ],
)
def test_bad_values_get_the_same_messages_as_before(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        PicServerSettings(PicConfig(), **bad)


def test_every_field_but_the_config_is_declared_in_field_order() -> None:
    names = [f.name for f in fields(PicServerSettings)]
    assert names[0] == "config" and [s.name for s in SERVER_SETTINGS] == names[1:]
    defaults = PicServerSettings(PicConfig())
    for s in SERVER_SETTINGS:
        assert getattr(defaults, s.name) == s.default and s.help
    # Set by the launcher itself, never by a flag.
    assert {s.name for s in SERVER_SETTINGS if not s.flag} == {"model_path", "refused", "secret"}
    # Only auto-chunking has a per-request form (chat's "pic": {"auto_chunk": ...}).
    assert {s.name: s.override for s in SERVER_SETTINGS if s.override is not Override.NONE} == {
        "auto_chunk": Override.CHAT
    }


def test_the_secret_stays_out_of_reprs() -> None:
    assert "s3cret" not in repr(PicServerSettings(PicConfig(), secret="s3cret"))
