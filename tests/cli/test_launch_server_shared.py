"""The launcher's and the settings' handling of --pic-shared-store (no server started)."""

from __future__ import annotations

import pytest

from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.cli.launch_server import build
from sgl_pic.config import PicConfig

MODEL = ["--model-path", "/some/model"]


def test_flag_is_ours_and_defaults_off() -> None:
    argv, ns, _ = build([*MODEL, "--pic-shared-store", "mooncake://10.0.0.5:50551"])
    assert ns.pic_shared_store == "mooncake://10.0.0.5:50551"
    assert not any(a.startswith("--pic-") or a.startswith("mooncake") for a in argv)
    assert build(MODEL)[1].pic_shared_store == ""


def test_settings_validate_the_url_and_travel_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for bad in ("redis://h:1", "mooncake://host", "mooncake://h:1?x=2"):
        with pytest.raises(ValueError, match="shared store URL"):
            PicServerSettings(PicConfig(), shared_store=bad)
    only_shared = PicServerSettings(
        PicConfig(), host_cache_mb=0, disk_cache_dir="", shared_store="mooncake://h:1"
    )
    assert only_shared.has_lower_tiers
    monkeypatch.delenv("SGLPIC_SETTINGS", raising=False)
    only_shared.to_env()
    assert PicServerSettings.from_env().shared_store == "mooncake://h:1"
