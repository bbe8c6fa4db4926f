"""Step 4 of a chunked batch: the online signals selection reads, over the assembled KV.

- the query-aware signal (``QueryProbe``): the tokens phase 2 computes whatever the policy
  says (fresh, forced, the last) run the first ``qa_layers`` layers over the assembled KV,
  and their queries score every position; every plan of the batch that reads it shares one
  pass per ``qa_layers`` value (``Signals.run``, before selection);
- CacheBlend's deviation (``DeviationProbe``): every token past the device prefix runs
  layers 0 and 1, and its layer-1 K/V are compared with the reused ones; run on demand,
  inside the plan's timed selection (``BatchSignals.deviation``).

``BatchSignals`` hands both to ``planner.select`` as data providers (``planner.Signals``).
"""

from __future__ import annotations

import contextlib
import time

import torch

from sgl_pic.core.runs import SubRequest, runs_of
from sgl_pic.engine.batch import BatchContext, Plans
from sgl_pic.engine.deviation_probe import DeviationProbe, ProbeDone
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.engine.query_probe import ProbeCut, QueryProbe, host_scores
from sgl_pic.selection import make_policy
from sgl_pic.selection.query_aware import query_positions


class Signals:
    """Reads: each plan's config, hits, misses, forced positions and layout; the assembled
    KV (lower-tier chunks get the probed layers loaded whole first, in order, on this
    thread; phase 2 loads the rest sparsely). Writes: ``ctx.query_scores`` (# [prompt_len]
    per plan whose policy reads the query-aware signal and that has chunks past its device
    prefix) and ``ctx.probe_seconds``."""

    def __init__(self, forwards: PhaseForwards) -> None:
        self.forwards = forwards

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        t0 = time.perf_counter()
        num_layers = self.forwards.kv.num_layers
        wanted: dict[int, list[int]] = {}
        for b, plan in plans.items():
            if make_policy(plan.config).needs_query_attention and (plan.hit_spans or plan.misses):
                layers = min(plan.config.qa_layers, num_layers)
                wanted.setdefault(layers, []).append(b)
        scores: dict[int, torch.Tensor] = {}
        for layers, group in wanted.items():
            scores.update(self.probe_pass({b: plans[b] for b in group}, layers, ctx))
        ctx.query_scores = scores
        ctx.probe_seconds = time.perf_counter() - t0

    def probe_pass(self, plans: Plans, layers: int, ctx: BatchContext) -> dict[int, torch.Tensor]:
        """One probe pass over ``layers`` layers for ``plans``: the query-aware signal
        # [prompt_len] of each."""
        fw = self.forwards
        for plan in plans.values():
            if plan.lower:
                fw.load_layers(plan, layers)
        must: dict[int, torch.Tensor] = {}
        for b, plan in plans.items():
            n, p = plan.num_tokens, plan.prefix
            assert plan.forced is not None
            fresh = torch.tensor(plan.layout.fresh_indices() + [n - 1])  # host: planning
            idx = torch.unique(torch.cat([plan.forced, fresh]).to(torch.int64))
            must[b] = idx[idx >= p]
        runs = {b: runs_of(idx) for b, idx in must.items()}
        cap = fw.phases.max_subrequests
        gap = 1
        # A live batch never holds more requests than the request table has rows, so one
        # run per request always fits.
        while cap is not None and sum(len(r) for r in runs.values()) > max(cap, len(runs)):
            # Merged gaps run these layers too: their K/V there become recomputed ones.
            runs = {b: runs_of(idx, gap) for b, idx in must.items()}
            gap *= 2
        probes: dict[int, QueryProbe] = {}
        subs: list[SubRequest] = []
        ids: list[torch.Tensor] = []
        row = 0
        for b, plan in plans.items():
            idx = torch.cat([torch.arange(a, z) for a, z in runs[b]])  # host: planning
            # The question's queries, not a deferred chunk's: it is fresh text in
            # ``plan.layout`` but content, not what the answer asks about.
            queries = query_positions(plan.pending.request.layout, plan.prefix)
            rows = row + torch.searchsorted(idx, queries)
            probes[b] = QueryProbe(fw.kv.pool, fw.slots(plan), rows, queries, layers, fw.reduce)
            toks = torch.tensor(plan.pending.token_ids, dtype=torch.int64)  # host: planning
            ids.append(toks[idx])
            subs += [SubRequest(plan.pool_idx, a, z - a) for a, z in runs[b]]
            row += idx.numel()
        phase = fw.phases.prepare(ctx.live, subs, torch.cat(ids).to(fw.kv.device))
        fw.metrics.probe_passes.inc()
        hooks = [p.after_attention for p in probes.values()]
        hooks.append(ProbeCut(layers).after_attention)
        with contextlib.suppress(ProbeDone):
            fw.run("probe", ctx.stack, phase, after_attention=hooks)
        return dict(zip(probes, host_scores(list(probes.values())), strict=True))

    def deviation(self, plan: RequestPlan, ctx: BatchContext) -> torch.Tensor:
        """CacheBlend's online signal # [prompt_len]. Needs every reused token in the pool
        first, so lower-tier chunks are loaded whole here (CacheBlend compares against all
        of them); they are still promoted after the batch."""
        fw = self.forwards
        fw.load_whole(plan)
        toks = plan.pending.token_ids
        n, p = len(toks), plan.prefix
        probe = DeviationProbe(fw.kv.pool, fw.slots(plan, p), reduce=fw.reduce)
        ids = torch.tensor(toks[p:], dtype=torch.int64, device=fw.kv.device)
        phase = fw.phases.prepare(ctx.live, [SubRequest(plan.pool_idx, p, n - p)], ids)
        with contextlib.suppress(ProbeDone):
            fw.run("deviation", ctx.stack, phase, after_layer=[probe.after_layer])
        if probe.deviation is None:
            raise RuntimeError("the deviation pass ended without reaching layer 1")
        dev = torch.zeros(n)  # host: planning
        dev[p:] = probe.deviation.cpu()
        fresh = plan.layout.fresh_indices()
        dev[torch.tensor(fresh, dtype=torch.int64)] = 0.0  # host: planning
        return dev


class BatchSignals:
    """The signals of one batch as ``planner.select`` reads them (``planner.Signals``):
    the shared pass's scores where it covered the plan, else a pass of the plan's own (a
    policy that reads the signal without declaring ``needs_query_attention``); the
    deviation on demand."""

    def __init__(self, step: Signals, plans: Plans, ctx: BatchContext) -> None:
        self.step = step
        self.ctx = ctx
        self._index = {id(plan): b for b, plan in plans.items()}

    def deviation(self, plan: RequestPlan) -> torch.Tensor:
        return self.step.deviation(plan, self.ctx)

    def query_attention(self, plan: RequestPlan) -> torch.Tensor:
        b = self._index[id(plan)]
        if b in self.ctx.query_scores:
            return self.ctx.query_scores[b]
        layers = min(plan.config.qa_layers, self.step.forwards.kv.num_layers)
        return self.step.probe_pass({b: plan}, layers, self.ctx)[b]
