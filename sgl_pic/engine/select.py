"""Step 5 of a chunked batch: which positions phase 2 recomputes, and as which runs.

Each plan's policy chooses (``planner.select``, reading the batch's signals through
``signals.BatchSignals``); its positions become contiguous runs (runs separated by at
most ``merge_gap`` tokens merged); a request's runs are merged across their smallest gaps
until they read at most the ``ReadCap``'s budget of KV (``bound_runs``: each run is a
sub-request that reads its whole prefix, see ``kv_reads``), and further until the phase
batch fits the attention backend's plan buffers (``fit_runs``). Merged gaps are
recomputed too: a superset of the policy's positions, never fewer."""

from __future__ import annotations

import torch

from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.runs import Run, runs_of
from sgl_pic.engine import planner
from sgl_pic.engine.batch import BatchContext, Plans
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.kv_reads import ReadCap
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.engine.signals import BatchSignals, Signals


class Select:
    """Reads: each plan's rankings, forced positions and layout (``Lookup``, ``Phase1``);
    ``ctx.query_scores`` and ``ctx.probe_seconds`` (``Signals``); CacheBlend's deviation on
    demand. Writes: each plan's config (calibrated r), selected positions and stats;
    ``ctx.runs``.

    ratios: calibrated CacheTune r per tier ("device", "host", "disk"), or None.
    merge_gap: phase-2 runs separated by at most this many tokens are merged.
    read_cap: the bound on each request's phase-2 KV reads (``bound_runs``); None: none.
    It depends on the model and the settings only, never on the backend or the batch, so
    the recomputed set is the same on every backend (and every tensor-parallel rank)."""

    def __init__(
        self,
        forwards: PhaseForwards,
        signals: Signals,
        ratios: dict[str, float] | None = None,
        merge_gap: int = 0,
        read_cap: ReadCap | None = None,
    ) -> None:
        self.forwards = forwards
        self.signals = signals
        self.ratios = ratios
        self.merge_gap = merge_gap
        self.read_cap = read_cap

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        signals = BatchSignals(self.signals, plans, ctx)
        runs: dict[int, list[Run]] = {}
        for b, plan in plans.items():
            sel = planner.select(plan, signals, self.ratios)
            if b in ctx.query_scores:
                # The shared probe pass ran before selection; each request waited for it.
                assert plan.stats is not None
                plan.stats = plan.stats._replace(
                    selection_seconds=plan.stats.selection_seconds + ctx.probe_seconds
                )
            runs[b] = bound_runs(
                runs_of(sel, self.merge_gap), plan.prefix, plan.num_tokens, self.read_cap
            )
        # Plain requests run as one sub-request each; later prefill pieces of requests
        # planned earlier (their runs already in ``ctx.runs``) as their runs.
        later = {b: r for b, r in ctx.runs.items() if b not in plans}
        plain = len(planner.pool_rows(ctx.live)) - len(plans) - len(later)
        plain += sum(len(r) for r in later.values())
        fit_runs(
            runs,
            plans,
            plain,
            self.forwards.phases.max_subrequests,
            self.merge_gap,
            self.forwards.metrics,
        )
        ctx.runs.update(runs)


def bound_runs(runs: list[Run], prefix: int, num_tokens: int, cap: ReadCap | None) -> list[Run]:
    """``runs`` of one request (positions prefix..num_tokens-1 past its device prefix)
    merged across their smallest gaps first (ties: the later gap, whose run reads more)
    until ``cap`` holds (``ReadCap.holds``); unchanged when it already does, when ``cap``
    is None or does not bind a request of ``num_tokens`` (``ReadCap.binds``). All merged,
    one run reads about what exact prefill reads, so the loop ends. The caller brings the
    plan's selection and stats in line (``merged``)."""
    if cap is None or len(runs) <= 1 or not cap.binds(num_tokens):
        return runs
    limits = cap.limits(prefix, num_tokens)
    reads = [cap.reads(a, z - a) for a, z in runs]
    total = [sum(col) for col in zip(*reads, strict=True)]
    tokens, count = sum(z - a for a, z in runs), len(runs)
    if cap.holds(total, tokens, count, limits):
        return runs
    # Merged runs are contiguous groups, each named by its first run (``head``).
    head = list(range(len(runs)))
    end = [run.end for run in runs]

    def find(i: int) -> int:
        while head[i] != i:
            head[i] = head[head[i]]
            i = head[i]
        return i

    gaps = sorted(range(len(runs) - 1), key=lambda i: (runs[i + 1].start - runs[i].end, -i))
    for i in gaps:
        left, right = find(i), i + 1  # the gap's right side is still its group's head
        start = runs[left].start
        joined = cap.reads(start, end[right] - start)
        parts = zip(total, joined, reads[left], reads[right], strict=True)
        total = [t + j - x - y for t, j, x, y in parts]
        tokens += runs[right].start - end[left]
        count -= 1
        head[right], end[left], reads[left] = left, end[right], joined
        if cap.holds(total, tokens, count, limits):
            break
    return [Run(runs[i].start, end[i]) for i in range(len(runs)) if find(i) == i]


def join(runs: list[Run], gap: int) -> list[Run]:
    """``runs`` with neighbours at most ``gap`` tokens apart made one."""
    out: list[Run] = []
    for run in runs:
        if out and run.start - out[-1].end <= gap:
            out[-1] = Run(out[-1].start, run.end)
        else:
            out.append(run)
    return out


def fit_runs(
    runs: dict[int, list[Run]],
    plans: Plans,
    plain: int,
    cap: int | None,
    merge_gap: int,
    metrics: PicMetrics,
) -> None:
    """Merges runs across growing gaps until the phase batch (``plain`` sub-requests
    besides the runs) fits ``cap`` sub-requests (``PhaseRunner.max_subrequests``; None: no
    limit); merged gaps are recomputed too, and the plans' selections and stats say so.
    Raises when every plan is down to one run and the batch still does not fit."""
    gap = max(merge_gap, 1)
    while cap is not None and plain + sum(len(r) for r in runs.values()) > cap:
        if all(len(runs[b]) <= 1 for b in plans):
            # Nothing left to merge (the rest are plain requests and later prefill pieces):
            # the batch runs as SGLang would. A decision on the batch's shape alone, so
            # every tensor-parallel rank takes it alike.
            raise RuntimeError("the phase batch has more sub-requests than the backend plans")
        for b in plans:
            runs[b] = join(runs[b], gap)
        gap *= 2
        metrics.run_merges.inc()
    for b, plan in plans.items():
        covered = sum(run.end - run.start for run in runs[b])
        if plan.selected is not None and covered != plan.selected.numel():
            merged(plan, runs[b])


def merged(plan: RequestPlan, runs: list[Run]) -> torch.Tensor:
    """The positions of merged runs (# [k']), with the plan's stats brought in line."""
    sel = torch.cat([torch.arange(a, z) for a, z in runs])  # host: planning
    assert plan.stats is not None and plan.selected is not None
    extra = planner.count_in(sel, plan.hit_spans) - planner.count_in(plan.selected, plan.hit_spans)
    plan.stats = plan.stats._replace(
        recomputed_tokens=int(sel.numel()),
        reused_tokens=plan.stats.reused_tokens - extra,
    )
    plan.selected = sel
    return sel
