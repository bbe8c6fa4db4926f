"""Step 6 of a chunked batch: phase 2, one forward of every chunked request's runs and
every plain request of the batch.

Each run is a sub-request over its request's own row (prefix: the row up to the run's
start), so it attends the reused KV and the fresh K/V of its request's earlier runs; a
plain request runs as itself. Lower-tier chunks are loaded during the forward, layer by
layer and only the tokens not recomputed (``LayerFeed``). Rows of tokens not recomputed
are zero in the hidden states; SGLang's logits processor reads only each request's last
row, which is always recomputed."""

from __future__ import annotations

import torch

from sgl_pic.core.runs import SubRequest
from sgl_pic.engine import planner
from sgl_pic.engine.batch import BatchContext, Plans
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.layer_feed import LayerFeed


class Phase2:
    """Reads: ``ctx.runs`` (``Select``, ``FirstPieces``; later prefill pieces' set by the
    executor) and ``ctx.rows``, each plan's selection and lower-tier hits, the live batch's
    plain requests. Writes: ``ctx.feed_timed_out`` and ``ctx.feed_failed``, the
    recomputed positions' KV, the lower-tier chunks' KV of the positions not recomputed,
    each plan's run count; ``ctx.hidden`` (# [n, hidden], the live batch's rows)."""

    def __init__(self, forwards: PhaseForwards) -> None:
        self.forwards = forwards

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        fw, live, input_ids = self.forwards, ctx.live, ctx.input_ids
        prefix_lens = list(live.extend_prefix_lens_cpu)
        ext_lens = list(live.extend_seq_lens_cpu)
        device = input_ids.device
        subs: list[SubRequest] = []
        rows: list[torch.Tensor] = []
        feeds: list[LayerFeed] = []
        row_in = 0
        for b, idx in enumerate(planner.pool_rows(live)):
            p, e = prefix_lens[b], ext_lens[b]
            runs = ctx.runs.get(b)
            if runs is None:
                subs.append(SubRequest(idx, p, e))
                rows.append(torch.arange(row_in, row_in + e, device=device))
            else:
                # Over the request's own row, or the scratch row of a request planned whole
                # over several prefill pieces (``pieces``).
                row = ctx.rows.get(b, idx)
                for run in runs:
                    subs.append(SubRequest(row, run.start, run.end - run.start))
                    rows.append(
                        torch.arange(row_in + run.start - p, row_in + run.end - p, device=device)
                    )
                plan = plans.get(b)
                if plan is not None:
                    plan.runs = len(runs)
                    if plan.lower:
                        assert plan.selected is not None
                        feeds.append(fw.feed(plan, plan.selected))
            row_in += e
        fw.metrics.phase2_runs.inc(sum(len(r) for r in ctx.runs.values()))
        if not subs:
            # Only prefill pieces before their last, none with a position to recompute:
            # SGLang reads no row of them (it samples nothing for such a piece).
            ctx.hidden = fw.empty_hidden(input_ids.shape[0])
            return
        take = torch.cat(rows)
        phase = fw.phases.prepare(live, subs, input_ids[take])
        for feed in feeds:
            feed.start()
        try:
            out = fw.run(
                "phase2", ctx.stack, phase, before_layer=[feed.before_layer for feed in feeds]
            )
        finally:
            for feed in feeds:
                feed.close()
        for feed in feeds:
            if not feed.done:
                raise RuntimeError("phase 2 ended before every layer's reused KV was loaded")
            fw.count_loaded(feed)
        ctx.feed_timed_out = any(feed.timed_out for feed in feeds)
        ctx.feed_failed = any(feed.failed for feed in feeds)
        hidden = out.new_zeros((input_ids.shape[0], out.shape[-1]))
        hidden[take] = out
        ctx.hidden = hidden
