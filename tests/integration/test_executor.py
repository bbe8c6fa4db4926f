"""Executor decisions that need no server: which r a cachetune request runs at, and L_cont."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.integration.executor import ChunkExecutor, _contiguous_hit_length, _Plan
from sgl_pic.integration.gate import Pending
from sgl_pic.integration.spans import PicRequest
from sgl_pic.layout import PromptLayout

RATIOS = {"device": 0.15, "host": 0.2, "disk": 0.35}


def _executor(ratios: dict[str, float] | None) -> ChunkExecutor:
    unused: Any = None  # _calibrated reads none of them
    return ChunkExecutor(PicConfig(policy="cachetune"), unused, unused, unused, ratios=ratios)


def _plan(
    tiers: set[str], overrides: dict[str, Any] | None = None, policy: str = "cachetune"
) -> _Plan:
    layout = PromptLayout.from_spans(10, [[0, 4], [4, 8]])
    request = PicRequest(layout, overrides or {})
    config = PicConfig(policy=policy).with_overrides(**(overrides or {}))
    plan = _Plan(0, 0, torch.arange(10), Pending(request, tuple(range(10))), config)
    plan.tiers = set(tiers)
    return plan


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [({"device"}, 0.15), ({"device", "host"}, 0.2), ({"host", "disk"}, 0.35), (set(), 0.15)],
)
def test_slowest_tier_sets_r(tiers: set[str], expected: float) -> None:
    # No tier (every chunk missed): the configured r (0.15 by default) stays.
    assert _executor(RATIOS)._calibrated(_plan(tiers)).cachetune_r == expected


def test_request_r_calibration_off_and_other_policies_are_left_alone() -> None:
    pinned = _plan({"disk"}, {"cachetune_r": 0.5})
    assert _executor(RATIOS)._calibrated(pinned).cachetune_r == 0.5
    assert _executor(None)._calibrated(_plan({"disk"})).cachetune_r == 0.15
    daric = _plan({"disk"}, policy="daric")
    assert _executor(RATIOS)._calibrated(daric) is daric.config


def test_contiguous_hit_length() -> None:
    layout = PromptLayout.from_spans(30, [[0, 10], [10, 20], [22, 30]])
    assert _contiguous_hit_length(layout, 0, [(0, 10), (10, 20), (22, 30)]) == 20  # gap at 20
    assert _contiguous_hit_length(layout, 0, [(10, 20)]) == 0  # first chunk missed
    assert _contiguous_hit_length(layout, 10, [(10, 20)]) == 20  # continues the prefix
    assert _contiguous_hit_length(layout, 5, []) == 0
