"""The planner without a server: hit classification, which r a cachetune request runs at,
L_cont, the merged selection and the runs phase 2 executes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.core.runs import runs_of
from sgl_pic.core.spans import PicRequest
from sgl_pic.engine import planner
from sgl_pic.engine.planner import ChunkLookup, RequestPlan
from sgl_pic.layout import PromptLayout

RATIOS = {"device": 0.15, "host": 0.2, "disk": 0.35}


class Given:
    """Signals as arrays (``planner.Signals``), each read counted."""

    def __init__(self, deviation: torch.Tensor, query: torch.Tensor | None = None) -> None:
        self._deviation, self._query = deviation, query
        self.reads: list[str] = []

    def deviation(self, plan: RequestPlan) -> torch.Tensor:
        self.reads.append("deviation")
        return self._deviation

    def query_attention(self, plan: RequestPlan) -> torch.Tensor:
        self.reads.append("query_attention")
        assert self._query is not None
        return self._query


def _plan(
    tiers: set[str] | None = None,
    overrides: dict[str, Any] | None = None,
    policy: str = "cachetune",
    spans: list[list[int]] | None = None,
    n: int = 10,
    prefix: int = 0,
) -> RequestPlan:
    layout = PromptLayout.from_spans(n, spans or [[0, 4], [4, 8]])
    request = PicRequest(layout, overrides or {})
    config = PicConfig(policy=policy).with_overrides(**(overrides or {}))
    plan = RequestPlan(0, 1, prefix, Pending(request, tuple(range(n))), config)
    plan.tiers = set(tiers or ())
    return plan


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [
        ({"device"}, 0.15),
        ({"device", "host"}, 0.2),
        ({"host", "disk"}, 0.35),
        ({"host", "shared"}, 0.35),
        (set(), 0.15),
    ],
)
def test_slowest_tier_sets_r(tiers: set[str], expected: float) -> None:
    # No tier (every chunk missed): the configured r (0.15 by default) stays. The shared
    # tier, never calibrated, takes the disk tier's r.
    assert planner.calibrated(_plan(tiers), RATIOS).cachetune_r == expected


def test_request_r_calibration_off_and_other_policies_are_left_alone() -> None:
    pinned = _plan({"disk"}, {"cachetune_r": 0.5})
    assert planner.calibrated(pinned, RATIOS).cachetune_r == 0.5
    assert planner.calibrated(_plan({"disk"}), None).cachetune_r == 0.15
    daric = _plan({"disk"}, policy="daric")
    assert planner.calibrated(daric, RATIOS) is daric.config


def test_contiguous_hit_length() -> None:
    assert planner.contiguous_hit_length(0, [(0, 10), (10, 20), (22, 30)]) == 20  # gap at 20
    assert planner.contiguous_hit_length(0, [(10, 20)]) == 0  # first chunk missed
    assert planner.contiguous_hit_length(10, [(10, 20)]) == 20  # continues the prefix
    assert planner.contiguous_hit_length(5, []) == 0


def test_classify_splits_prefix_hits_and_misses() -> None:
    # Chunks [0,4) [4,8) [8,12) [14,18) [18,20); device prefix 6 cuts the second chunk.
    plan = _plan(spans=[[0, 4], [4, 8], [8, 12], [14, 18], [18, 20]], n=20, prefix=6)
    seen: list[tuple[int, int]] = []
    answers = {
        (8, 12): ChunkLookup(None, None),
        (14, 18): ChunkLookup("host", torch.ones(4)),
        (18, 20): ChunkLookup("shared", None),
    }

    def lookup(start: int, end: int) -> ChunkLookup:
        seen.append((start, end))
        return answers[(start, end)]

    planner.classify(plan, lookup)
    assert seen == [(8, 12), (14, 18), (18, 20)]  # prefix chunks are never looked up
    assert plan.misses == [(8, 12)] and plan.hit_spans == [(14, 18), (18, 20)]
    assert plan.forced is not None and plan.forced.tolist() == [6, 7]  # the cut chunk's tail
    assert plan.tiers == {"host", "shared"} and len(plan.rankings) == 5
    s = plan.stats
    assert s is not None
    assert (s.device_prefix_chunks, s.contiguous_hits, s.disjoint_hits) == (1, 0, 2)
    assert (s.host_hits, s.disk_hits, s.shared_hits) == (1, 0, 1)
    assert (s.reused_tokens, s.new_tokens, s.prefix_hit_tokens) == (6, 14, 6)


def test_a_chunk_the_prefix_cuts_reuses_a_copy_or_is_encoded_whole() -> None:
    # The device prefix (6) ends inside chunk [4, 8): its tail is looked up once, with the
    # prefix. A stored copy makes 6..7 reused; an admitted miss is encoded whole by phase
    # 1 (a miss from 4) and 6..7 reused from it; a miss admission defers is recomputed.
    cases = (
        ("device", True, [], 2 + 4, [(6, 8), (8, 12)], []),
        (None, True, [], 4, [(8, 12)], [(4, 8)]),
        (None, False, [6, 7], 4, [(8, 12)], []),
    )
    for tier, admit, forced, reused, hits, misses in cases:
        plan = _plan(spans=[[0, 4], [4, 8], [8, 12]], n=16, prefix=6)
        tails: list[tuple[int, int, int]] = []

        def lookup_tail(
            start: int,
            end: int,
            keep: int,
            tier: str | None = tier,
            admit: bool = admit,
            tails: list = tails,
        ) -> ChunkLookup:
            tails.append((start, end, keep))
            return ChunkLookup(tier, torch.arange(4.0) if tier else None, admit)

        planner.classify(plan, lambda s, e: ChunkLookup("device", None), lookup_tail)
        assert tails == [(4, 8, 6)]
        assert plan.forced is not None and plan.forced.tolist() == forced
        assert plan.hit_spans == hits and plan.misses == misses and plan.deferred == []
        assert len(plan.rankings) == 3
        s = plan.stats
        assert s is not None and s.reused_tokens == reused
        if tier:
            assert plan.rankings[1] is not None
            assert (s.contiguous_hits, s.device_hits, s.prefix_hit_tokens) == (2, 2, 12)
        else:
            assert (s.contiguous_hits, s.disjoint_hits) == (0, 1)  # after the cut miss


def test_select_refines_by_prefix_and_counts_reuse() -> None:
    plan = _plan(spans=[[0, 8], [8, 16]], n=20, prefix=4, policy="epic", overrides={"epic_k": 2})
    planner.classify(plan, lambda s, e: ChunkLookup("device", None))
    sel = planner.select(plan, Given(torch.zeros(20)))
    # EPIC: first 2 of each chunk (0, 1 dropped as device prefix; the first chunk's tail
    # 4..7 is forced), then fresh 16..19 (including the last token).
    assert sel.tolist() == [4, 5, 6, 7, 8, 9, 16, 17, 18, 19]
    assert plan.selected is sel
    assert plan.stats is not None and plan.stats.recomputed_tokens == 10
    assert plan.stats.reused_tokens == 8 - 2  # the second chunk's 8 minus its 2 recomputed


def test_runs_of_and_merging() -> None:
    sel = torch.tensor([3, 4, 5, 9, 11, 12, 20])
    assert runs_of(sel) == [(3, 6), (9, 10), (11, 13), (20, 21)]
    assert runs_of(sel, merge_gap=1) == [(3, 6), (9, 13), (20, 21)]
    assert runs_of(sel, merge_gap=8) == [(3, 21)]
    assert runs_of(torch.empty(0, dtype=torch.int64)) == []
    # Runs cover exactly the positions when nothing is merged.
    covered = torch.cat([torch.arange(a, b) for a, b in runs_of(sel)])
    assert covered.tolist() == sel.tolist()


def test_runs_are_merged_until_the_phase_batch_fits() -> None:
    from types import SimpleNamespace

    from sgl_pic.engine.select import fit_runs

    merges = SimpleNamespace(n=0)
    metrics = SimpleNamespace(
        run_merges=SimpleNamespace(inc=lambda: setattr(merges, "n", merges.n + 1))
    )
    plan = _plan(spans=[[0, 8], [8, 16]], n=20, policy="epic")
    planner.classify(plan, lambda s, e: ChunkLookup("device", None))
    plan.selected = torch.tensor([1, 3, 5, 7, 9, 19])
    runs = {0: runs_of(plan.selected)}
    fit_runs(runs, {0: plan}, plain=1, cap=4, merge_gap=0, metrics=metrics)  # type: ignore[arg-type]
    # 6 runs + 1 plain request > 4: gap 1 joins 1..9 into one run, leaving 2 + 1.
    assert runs[0] == [(1, 10), (19, 20)] and merges.n == 1
    assert plan.selected.tolist() == [*range(1, 10), 19]
    assert plan.stats is not None and plan.stats.recomputed_tokens == 10


def test_a_batch_that_cannot_fit_once_every_plan_is_one_run_is_refused() -> None:
    # Plain requests and later prefill pieces cannot be merged: past one run per plan the
    # batch runs as SGLang would (raised), instead of merging forever.
    from types import SimpleNamespace

    from sgl_pic.engine.select import fit_runs

    metrics = SimpleNamespace(run_merges=SimpleNamespace(inc=lambda: None))
    plan = _plan(spans=[[0, 8], [8, 16]], n=20, policy="epic")
    planner.classify(plan, lambda s, e: ChunkLookup("device", None))
    plan.selected = torch.tensor([1, 3, 19])
    runs = {0: runs_of(plan.selected)}
    with pytest.raises(RuntimeError, match="sub-requests"):
        fit_runs(runs, {0: plan}, plain=4, cap=4, merge_gap=0, metrics=metrics)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="sub-requests"):
        fit_runs({}, {}, plain=5, cap=4, merge_gap=0, metrics=metrics)  # type: ignore[arg-type]


def test_a_deferred_miss_is_fresh_text_computed_whole() -> None:
    # Chunks [0,4) [4,8) [8,12); [4,8) missed and store admission deferred it: it is not
    # for phase 1, it is forced whole, and selection sees it as fresh text.
    plan = _plan(spans=[[0, 4], [4, 8], [8, 12]], n=16, policy="epic", overrides={"epic_k": 1})
    answers = {
        (0, 4): ChunkLookup("device", torch.ones(4)),
        (4, 8): ChunkLookup(None, None, admit=False),
        (8, 12): ChunkLookup("device", torch.zeros(4)),
    }
    planner.classify(plan, lambda s, e: answers[(s, e)])
    assert plan.misses == [] and plan.deferred == [(4, 8)]
    assert plan.forced is not None and plan.forced.tolist() == [4, 5, 6, 7]
    assert [(c.start, c.end) for c in plan.layout.chunks] == [(0, 4), (8, 12)]
    assert [(c.start, c.end) for c in plan.pending.request.layout.chunks] == [
        (0, 4),
        (4, 8),
        (8, 12),
    ]
    assert len(plan.rankings) == 2 and plan.rankings[1] is answers[(8, 12)].ranking
    s = plan.stats
    assert s is not None
    assert (s.deferred, s.misses, s.contiguous_hits, s.disjoint_hits) == (1, 0, 1, 1)
    assert s.reused_tokens == 8  # the two hits; the deferred chunk reuses nothing
    sel = planner.select(plan, Given(torch.zeros(16)))
    # EPIC's first token of the reused chunk after position 0, the deferred chunk whole,
    # and the fresh tail.
    assert sel.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15]
    assert plan.stats is not None and plan.stats.reused_tokens == 8 - 1


def test_pool_rows_come_from_sglangs_host_copy_without_reading_the_device() -> None:
    from types import SimpleNamespace

    def device_read() -> list[int]:
        raise AssertionError("read the device tensor although the host copy was there")

    live = SimpleNamespace(
        req_pool_indices=SimpleNamespace(tolist=device_read),
        req_pool_indices_cpu=torch.tensor([3, 1]),
    )
    assert planner.pool_rows(live) == [3, 1]
    # A batch without the host copy (SGLang leaves it None outside plain extend batches).
    bare = SimpleNamespace(req_pool_indices=torch.tensor([2, 5]), req_pool_indices_cpu=None)
    assert planner.pool_rows(bare) == [2, 5]


def test_select_reads_only_the_signals_its_policy_needs() -> None:
    plan = _plan(spans=[[0, 8], [8, 16]], n=20, policy="epic", overrides={"epic_k": 2})
    planner.classify(plan, lambda s, e: ChunkLookup("device", None))
    given = Given(torch.zeros(20))
    planner.select(plan, given)
    assert given.reads == []
    plan = _plan(spans=[[0, 8], [8, 16]], n=20, policy="cacheblend")
    planner.classify(plan, lambda s, e: ChunkLookup("device", None))
    deviation = torch.zeros(20)
    deviation[10] = 5.0
    given = Given(deviation)
    sel = planner.select(plan, given)
    assert given.reads == ["deviation"] and 10 in sel.tolist()
