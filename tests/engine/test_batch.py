"""``batch.chunk_specs``: which requests of a live batch the chunk path takes, and how (a
whole prompt, the first of several prefill pieces, a later piece of a carried plan)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.runs import Run
from sgl_pic.engine.batch import ChunkSpec, PieceSpec, chunk_specs
from sgl_pic.engine.pieces import Reservation
from tests.engine.test_planner import _plan


class Counts:
    def __init__(self) -> None:
        self.counts = {"resumed": 0, "fallbacks": 0}
        for name in self.counts:
            setattr(self, name, SimpleNamespace(inc=lambda name=name: self._inc(name)))

    def _inc(self, name: str) -> None:
        self.counts[name] += 1


class Carried:
    """``PiecePlans.get``/``drop`` over a dict."""

    def __init__(self, plans: dict[str, Any] | None = None) -> None:
        self.plans = dict(plans or {})
        self.dropped: list[str] = []

    def get(self, rid: str) -> Any:
        return self.plans.get(rid)

    def drop(self, rid: str) -> None:
        self.dropped.append(rid)
        self.plans.pop(rid, None)


def _live(prefix: list[int], ext: list[int], rids: list[str], logprob: bool = False) -> Any:
    return SimpleNamespace(
        rids=rids,
        req_pool_indices_cpu=torch.tensor(list(range(1, len(rids) + 1))),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=ext,
        return_logprob=logprob,
        extend_logprob_start_lens_cpu=[0] * len(rids),
    )


def _carried(next_start: int, num_tokens: int = 10) -> Any:
    from sgl_pic.engine.pieces import CarriedPlan

    res = Reservation(7, torch.arange(num_tokens - 4), 4, num_tokens)
    return CarriedPlan(res, (Run(2, 3), Run(9, 10)), next_start)


def test_a_retracted_request_resumes_as_sglang_would_and_is_not_a_fallback() -> None:
    # SGLang's retract_decode frees a running request and queues it again; its next extend
    # covers the prompt and the output so far (more tokens than the marks were verified
    # for). It runs as SGLang would, counted as resumed, not as a fallback.
    metrics = Counts()
    pending = _plan(spans=[[0, 4], [4, 8]], n=10).pending
    live = _live([9], [1 + 5], ["r"])
    got = chunk_specs(live, {"r": pending}, PicConfig(), metrics, Carried())
    assert got.specs == {} and got.pieces == {}
    assert metrics.counts == {"resumed": 1, "fallbacks": 0}


def test_a_first_piece_is_planned_whole_not_a_fallback() -> None:
    metrics = Counts()
    pending = _plan(spans=[[0, 4], [4, 8]], n=10).pending
    got = chunk_specs(_live([0], [6], ["r"]), {"r": pending}, PicConfig(), metrics, Carried())
    assert list(got.specs) == [0] and got.pieces == {}
    spec = got.specs[0]
    assert spec.first_piece and spec.piece_end == 6 and spec.prefix == 0
    assert spec.plan().first_piece and spec.plan().piece_end == 6
    assert metrics.counts == {"resumed": 0, "fallbacks": 0}


def test_a_later_piece_runs_its_carried_plan() -> None:
    pending = _plan(spans=[[0, 4], [4, 8]], n=10).pending
    carried = Carried({"r": _carried(4)})
    live = _live([0, 4], [3, 6], ["plain", "r"])
    got = chunk_specs(live, {"r": pending}, PicConfig(), Counts(), carried)
    assert got.specs == {}
    assert got.pieces == {1: PieceSpec("r", 3, 2, 4, 10, carried.plans["r"])}


def test_a_piece_that_does_not_follow_its_plan_drops_it_and_is_planned_afresh() -> None:
    # Not where the plan left off (its previous piece ran without it, say): what the
    # request's row holds is no longer what the plan assembled.
    pending = _plan(spans=[[0, 4], [4, 8]], n=10).pending
    carried = Carried({"r": _carried(4)})
    got = chunk_specs(_live([6], [4], ["r"]), {"r": pending}, PicConfig(), Counts(), carried)
    assert carried.dropped == ["r"] and got.pieces == {}
    assert list(got.specs) == [0] and got.specs[0].prefix == 6
    assert not got.specs[0].first_piece


def test_input_logprobs_run_as_sglang_would_counted_and_drop_a_carried_plan() -> None:
    metrics = Counts()
    pending = _plan(spans=[[0, 4], [4, 8]], n=10).pending
    carried = Carried({"r": _carried(4)})
    live = _live([4], [6], ["r"], logprob=True)
    got = chunk_specs(live, {"r": pending}, PicConfig(), metrics, carried)
    assert got.specs == {} and got.pieces == {} and carried.dropped == ["r"]
    assert metrics.counts == {"resumed": 0, "fallbacks": 1}


def test_the_spec_of_a_whole_chunked_prompt_is_named() -> None:
    pending = _plan(spans=[[0, 4], [4, 8]], n=10, overrides={"epic_k": 2}).pending
    live = SimpleNamespace(
        rids=["plain", "r"],
        req_pool_indices_cpu=torch.tensor([3, 1]),
        extend_prefix_lens_cpu=[0, 2],
        extend_seq_lens_cpu=[5, 8],
        return_logprob=False,
    )
    specs, pieces = chunk_specs(live, {"r": pending}, PicConfig(), SimpleNamespace(), Carried())
    assert list(specs) == [1] and pieces == {}
    spec = specs[1]
    assert isinstance(spec, ChunkSpec)
    assert (spec.row_offset, spec.pool_idx, spec.prefix, spec.pending) == (5, 1, 2, pending)
    assert spec.config == pending.request.config(PicConfig()) and not spec.first_piece
    plan = spec.plan()
    assert (plan.row_offset, plan.pool_idx, plan.prefix) == (5, 1, 2) and plan.config is spec.config
