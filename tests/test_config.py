"""PicConfig's declared settings (``sgl_pic.config``): validation messages as they were
before the declarations (f33133e), every field declared, the per-request override rule."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any

import pytest

from sgl_pic.config import CONFIG_SETTINGS, REQUEST_OVERRIDES, PicConfig
from sgl_pic.declare import Override


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"policy": "nope"},
            "unknown policy 'nope'; valid policies: full_recompute, full_reuse, epic, "
            "cacheblend, daric, cachetune, query_aware",
        ),
        ({"policy": 3}, "policy must be a string, got 3"),
        ({"daric_r": 0.0}, "daric_r must be in (0, 1], got 0.0"),
        ({"daric_r": 1.5}, "daric_r must be in (0, 1], got 1.5"),
        ({"daric_r": True}, "daric_r must be a finite number, got True"),
        ({"daric_r": math.nan}, "daric_r must be a finite number, got nan"),
        ({"daric_r": "0.1"}, "daric_r must be a finite number, got '0.1'"),
        ({"daric_n_avg": 0}, "daric_n_avg must be in (0, 1048576], got 0.0"),
        ({"daric_n_avg": 2000000.0}, "daric_n_avg must be in (0, 1048576], got 2000000.0"),
        ({"daric_mtaf": "cubic"}, "unknown MTAF 'cubic'; valid MTAFs: linear, log, exp"),
        ({"daric_mtaf": 1}, "daric_mtaf must be a string, got 1"),
        ({"daric_max_iters": -1}, "daric_max_iters must be in [0, 16], got -1"),
        ({"daric_max_iters": 17}, "daric_max_iters must be in [0, 16], got 17"),
        ({"daric_max_iters": 2.0}, "daric_max_iters must be an integer, got 2.0"),
        ({"epic_k": -1}, "epic_k must be in [0, 1048576], got -1"),
        ({"epic_k": True}, "epic_k must be an integer, got True"),
        ({"cacheblend_ratio": 0}, "cacheblend_ratio must be in (0, 1], got 0.0"),
        ({"cachetune_r": 2}, "cachetune_r must be in (0, 1], got 2.0"),
        ({"cachetune_alpha": 0.0}, "cachetune_alpha must be in (0, 1], got 0.0"),
        ({"qa_ratio": -0.1}, "qa_ratio must be in (0, 1], got -0.1"),
        ({"qa_min_tokens": -1}, "qa_min_tokens must be in [0, 1048576], got -1"),
        ({"qa_min_tokens": 2097152}, "qa_min_tokens must be in [0, 1048576], got 2097152"),
        ({"qa_sink_tokens": -1}, "qa_sink_tokens must be in [0, 1048576], got -1"),
        ({"qa_layers": 0}, "qa_layers must be in [1, 16], got 0"),
        ({"qa_layers": 17}, "qa_layers must be in [1, 16], got 17"),
        ({"segment_tokens": 0}, "segment_tokens must be in [1, 1048576], got 0"),
        ({"page_size": 0}, "page_size must be in [1, 65536], got 0"),
        ({"page_size": 70000}, "page_size must be in [1, 65536], got 70000"),
        ({"delimiter": ""}, "delimiter must be a non-empty string"),
        ({"delimiter": 5}, "delimiter must be a string, got 5"),
        ({"max_chunks": 0}, "max_chunks must be in [1, 65536], got 0"),
        ({"max_chunks": 131072}, "max_chunks must be in [1, 65536], got 131072"),
        ({"min_chunk_tokens": 0}, "min_chunk_tokens must be in [1, 1048576], got 0"),
        ({"auto_chunk_min_tokens": 0}, "auto_chunk_min_tokens must be in [1, 1048576], got 0"),
        ({"qa_ratio": math.inf}, "qa_ratio must be a finite number, got inf"),
        ({"qa_layers": None}, "qa_layers must be an integer, got None"),
    ],
)
def test_bad_values_get_the_same_messages_as_before(bad: dict[str, Any], message: str) -> None:
    # HTTP 400s carry these messages (per-request overrides), so they are the interface.
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        PicConfig(**bad)
    if set(bad) <= REQUEST_OVERRIDES:
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            PicConfig().with_overrides(**bad)


def test_every_field_is_declared_once_in_field_order() -> None:
    assert [s.name for s in CONFIG_SETTINGS] == [f.name for f in fields(PicConfig)]
    defaults = PicConfig()
    for s in CONFIG_SETTINGS:
        assert getattr(defaults, s.name) == s.default and s.type in ("int", "float", "str")
        assert s.help and (s.flag or s.name == "page_size")  # page size: SGLang's --page-size


def test_requests_may_override_what_they_could_before() -> None:
    # The set sgl_pic.core.spans.OVERRIDABLE listed at f33133e.
    assert {
        "policy", "daric_r", "daric_n_avg", "daric_mtaf", "daric_max_iters", "epic_k",
        "cacheblend_ratio", "cachetune_r", "qa_ratio", "qa_min_tokens", "qa_sink_tokens",
        "qa_layers",
    } == REQUEST_OVERRIDES  # fmt: skip
    # Server-only: they change how chunks are keyed, bounded or ranked when stored.
    assert {s.name for s in CONFIG_SETTINGS if s.override is Override.NONE} == {
        "cachetune_alpha", "chunk_context", "segment_tokens", "page_size", "delimiter",
        "max_chunks", "min_chunk_tokens", "auto_chunk_min_tokens",
    }  # fmt: skip


def test_the_http_edge_allows_exactly_the_declared_overrides() -> None:
    from sgl_pic.core.spans import OVERRIDABLE

    assert OVERRIDABLE == REQUEST_OVERRIDES


def test_floats_are_one_value_whatever_their_spelling() -> None:
    assert PicConfig(daric_n_avg=32) == PicConfig(daric_n_avg=32.0)
    assert type(PicConfig(qa_ratio=1).qa_ratio) is float
    assert PicConfig(qa_ratio=1).exact and PicConfig(policy="full_recompute").exact


def test_chunk_context_is_checked_and_names_its_approximation() -> None:
    with pytest.raises(ValueError, match="unknown chunk context 'system'"):
        PicConfig(chunk_context="system")
    with pytest.raises(ValueError, match="needs page size 1"):
        PicConfig(chunk_context="first_chunk", page_size=16)
    # Chunks encoded after their first chunk are other KV: no prefix shared with alone.
    alone, after = PicConfig(), PicConfig(chunk_context="first_chunk")
    assert alone.approximation_key() != after.approximation_key()
    assert after.with_overrides(qa_ratio=1.0).approximation_key() == "exact"
