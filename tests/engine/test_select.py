"""Phase 2's runs (``engine.select``): the read cap merges a request's runs across their
smallest gaps until its plans read within budget, on every backend alike, recomputing a
superset of the selection; merging to fit the backend's buffers keeps what the cap
merged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.core.runs import Run, runs_of
from sgl_pic.core.spans import PicRequest
from sgl_pic.engine import planner
from sgl_pic.engine.kv_reads import (
    BACKENDS,
    AttnShape,
    SubRequest,
    exact_reads,
    planned_reads,
    read_cap,
)
from sgl_pic.engine.planner import ChunkLookup, RequestPlan
from sgl_pic.engine.select import bound_runs, fit_runs
from sgl_pic.layout import PromptLayout


def spread(n: int, seed: int = 0) -> list[Run]:
    """Runs of 1-4 tokens, 8% of positions starting one, and the last 40 tokens."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.nonzero(torch.rand(n - 40, generator=g) < 0.08).flatten().tolist()
    lens = torch.randint(1, 5, (len(starts),), generator=g).tolist()
    pos = sorted({p for s, k in zip(starts, lens, strict=True) for p in range(s, s + k)})
    return runs_of(torch.tensor(pos + list(range(n - 40, n))))


def positions(runs: list[Run]) -> set[int]:
    return {p for a, z in runs for p in range(a, z)}


def ratio(runs: list[Run], n: int, shape: AttnShape, backend: str) -> float:
    subs = [SubRequest(a, z - a) for a, z in runs]
    return planned_reads(backend, subs, shape) / exact_reads(backend, n, shape)


def test_no_cap_or_a_cap_that_holds_leaves_runs_alone() -> None:
    runs = spread(4096)
    assert bound_runs(runs, 0, 4096, None) is runs
    assert bound_runs(runs, 0, 4096, read_cap(4, 128, 1000)) is runs
    assert bound_runs(runs[-1:], 0, 4096, read_cap(4, 128, 1.0)) == runs[-1:]


def test_capped_runs_cover_the_selection_and_read_within_budget_on_both_plans() -> None:
    n = 8192
    for shape in (AttnShape(4, 128), AttnShape(1, 128), AttnShape(3, 64)):
        runs = spread(n, seed=shape.group)
        before = {b: ratio(runs, n, shape, b) for b in BACKENDS}
        assert min(before.values()) > 1.5  # the problem: many runs, each its whole prefix
        capped = bound_runs(runs, 0, n, read_cap(shape.group, shape.head_dim, 1.25))
        assert positions(runs) <= positions(capped)
        assert all(a < z for a, z in capped)
        assert all(capped[i].end < capped[i + 1].start for i in range(len(capped) - 1))
        for backend in BACKENDS:
            # The cap counts whole tokens per tile and no KV blocks: within a few percent.
            assert ratio(capped, n, shape, backend) <= 1.25 * 1.03, (shape, backend)
        # Not merged to one run: the cap stops once it holds.
        assert 1 < len(capped) < len(runs)


def test_the_cap_binds_from_its_floor_on() -> None:
    n = 8192
    runs = spread(n)
    below = read_cap(4, 128, 1.25, min_tokens=n + 1)
    assert below is not None and not below.binds(n)
    assert bound_runs(runs, 0, n, below) is runs
    at = bound_runs(runs, 0, n, read_cap(4, 128, 1.25, min_tokens=n))
    assert len(at) < len(runs)
    assert at == bound_runs(runs, 0, n, read_cap(4, 128, 1.25))


def test_smallest_gaps_merge_first() -> None:
    # Gaps of 1, 5 and 3 tokens far along a 1013-token prompt: four runs read about
    # 4 x 1000 keys, over the 3893 of exact prefill's six 192-token tiles (FA3, head_dim
    # 64, MHA); merging the 1-token gap leaves three, within budget.
    runs = [Run(1000, 1001), Run(1002, 1003), Run(1008, 1009), Run(1012, 1013)]
    cap = read_cap(1, 64, 1.0)
    assert cap is not None
    fa3_limit, _ = cap.limits(0, 1013)
    reads = sum(cap.reads(a, z - a)[0] for a, z in runs)
    assert (reads, fa3_limit) == (4026, 3893)
    merged = bound_runs(runs, 0, 1013, cap)
    assert merged == [Run(1000, 1003), *runs[2:]]
    assert positions(runs) <= positions(merged)
    # The device prefix counts: the same runs past a 990-token prefix fit far less.
    assert len(bound_runs(runs, 990, 1013, cap)) == 1


def _plan(n: int) -> RequestPlan:
    layout = PromptLayout.from_spans(n, [[0, n // 2], [n // 2, n - 4]])
    config = PicConfig(policy="epic")
    plan = RequestPlan(0, 1, 0, Pending(PicRequest(layout, {}), tuple(range(n))), config)
    planner.classify(plan, lambda s, e: ChunkLookup("device", None))
    return plan


def test_fitting_the_backend_keeps_the_caps_merges_and_stats_follow() -> None:
    # The cap merged [10, 40) across gaps the selection had; fitting the batch into 3
    # sub-requests merges the capped runs further, never splitting what the cap merged.
    plan = _plan(100)
    plan.selected = torch.tensor([10, 20, 39, 60, 61, 80, 99])
    planner.select(plan, SimpleNamespace())  # type: ignore[arg-type]
    plan.selected = torch.tensor([10, 20, 39, 60, 61, 80, 99])
    assert plan.stats is not None
    plan.stats = plan.stats._replace(recomputed_tokens=7)
    runs = {0: [Run(10, 40), Run(60, 62), Run(80, 81), Run(99, 100)]}
    metrics = SimpleNamespace(run_merges=SimpleNamespace(inc=lambda: None))
    fit_runs(runs, {0: plan}, plain=0, cap=3, merge_gap=0, metrics=metrics)  # type: ignore[arg-type]
    assert positions([Run(10, 40)]) <= positions(runs[0]) and len(runs[0]) <= 3
    assert plan.selected.tolist() == sorted(positions(runs[0]))
    assert plan.stats.recomputed_tokens == len(positions(runs[0]))
    # Without a backend limit, fit_runs still brings the selection in line with the cap.
    plan.selected = torch.tensor([10, 20, 39, 99])
    capped = {0: [Run(10, 40), Run(99, 100)]}
    fit_runs(capped, {0: plan}, plain=0, cap=None, merge_gap=0, metrics=metrics)  # type: ignore[arg-type]
    assert plan.selected.tolist() == [*range(10, 40), 99]
    assert plan.stats.recomputed_tokens == 31


def recording(server: Any, seen: list[list[Run]]) -> None:
    """Notes the runs of every phase batch ``server``'s phase runner prepares."""
    prepare = server.phases.prepare

    def recorded(live: Any, subs: list[Any], ids: torch.Tensor) -> Any:
        seen.append([Run(s.prefix, s.prefix + s.extend) for s in subs])
        return prepare(live, subs, ids)

    server.phases.prepare = recorded


def test_the_executor_runs_the_capped_runs() -> None:
    # The executor harness of test_host_syncs (SGLang's request table, a fake pool, a
    # deterministic stack): the same prompt twice (stored, then reused) on two servers,
    # one with the cap. Phase 2 of the capped one runs the uncapped runs bounded.
    from tests.engine.test_host_syncs import DIM, HEADS, KV_HEADS, Server, chunk, question

    cap = read_cap(HEADS // KV_HEADS, DIM, 1.0)
    prompt = [([chunk(0), chunk(1), chunk(2), chunk(3)], question(0))]
    phase2: list[list[Run]] = []
    for server_cap in (None, cap):
        server = Server("query_aware")
        server.executor.select.read_cap = server_cap
        seen: list[list[Run]] = []
        recording(server, seen)
        server.run(prompt)
        server.run(prompt)
        phase2.append(seen[-1])  # the reusing batch's phase 2: its last phase forward
    uncapped, capped = phase2
    n = 4 * len(chunk(0)) + len(question(0))
    assert len(uncapped) > len(capped) >= 1
    assert capped == bound_runs(uncapped, 0, n, cap)
    assert positions(uncapped) < positions(capped)
