"""``PhaseForwards``: what every step of a chunked batch uses to reach the KV pool and run
phase forwards: a request's slots, counted phase forwards through the phase runner, and
layer feeds of lower-tier chunks. It holds no per-batch state; worker side (the
scheduler's forward thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.runs import attended_keys
from sgl_pic.engine.batch import Stack
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.layer_feed import LayerFeed
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.phase_port import PhaseBatch, PhaseRunner
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.engine.rank_agreement import RankAgreement


class HiddenSpec(NamedTuple):
    """The decoder stack's output rows: width and dtype (the model's hidden size and
    dtype)."""

    size: int
    dtype: torch.dtype


class PhaseForwards:
    """kv:      the KV pool's reader/writer.
    phases:    runs phase batches through SGLang's backend and the decoder stack.
    metrics:   where phase forwards and loaded bytes are counted.
    lower:     host and disk tiers, or None when both are off.
    feed_mode: how lower-tier KV is loaded during phase 2 ("threaded" or "inorder").
    feed_timeout_s: longest wait for one layer of lower-tier KV (``FeedTimeout`` past it).
    reduce:    sums a device tensor over the tensor-parallel ranks (None on one rank).
    ranks:     the ranks' agreement; each phase forward starts with its ``proceed``, so a
               rank that failed this batch meets the others before their forward.
    hidden:    the decoder stack's output rows, for a batch that needs no forward at all
               (``empty_hidden``); None where the caller never has one."""

    def __init__(
        self,
        kv: KVAccess,
        phases: PhaseRunner,
        metrics: PicMetrics,
        lower: LowerTiers | None = None,
        feed_mode: str = "threaded",
        feed_timeout_s: float = 30.0,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        hidden: HiddenSpec | None = None,
        ranks: RankAgreement | None = None,
    ) -> None:
        self.kv = kv
        self.ranks = ranks if ranks is not None else RankAgreement()
        self.hidden = hidden
        self.phases = phases
        self.metrics = metrics
        self.lower = lower
        self.feed_mode = feed_mode
        self.feed_timeout_s = feed_timeout_s
        self.reduce = reduce

    def slots(self, plan: RequestPlan, start: int = 0, end: int | None = None) -> torch.Tensor:
        """# [end - start] pool slots of the request's positions start..end-1."""
        stop = plan.num_tokens if end is None else end
        return self.phases.req_to_token[plan.pool_idx, start:stop].to(torch.int64)

    def run(self, kind: str, stack: Stack, phase: PhaseBatch, **callbacks: Any) -> torch.Tensor:
        """``PhaseRunner.run`` (with the layer and attention ``callbacks`` it takes),
        counted by kind (``PicMetrics.phase_forwards``) before it runs, so that a pass its
        probe cuts short counts too; # [sum extend, hidden]. Raises ``PeerFailed`` first
        when another tensor-parallel rank failed this batch."""
        self.ranks.proceed()
        self.metrics.phase_forwards.labels(phase=kind).inc()
        tokens = sum(sub.extend for sub in phase.subrequests)
        self.metrics.phase_forward_tokens.labels(phase=kind).inc(tokens)
        self.metrics.phase_attended_keys.labels(phase=kind).inc(attended_keys(phase.subrequests))
        return self.phases.run(stack, phase, **callbacks)

    def empty_hidden(self, n: int) -> torch.Tensor:
        """# [n, hidden] zeros: the stack's output for a batch no row of which is read."""
        if self.hidden is None:
            raise RuntimeError("the decoder stack's hidden size is not known here")
        return torch.zeros((n, self.hidden.size), dtype=self.hidden.dtype, device=self.kv.device)

    def feed(self, plan: RequestPlan, sel: torch.Tensor, mode: str | None = None) -> LayerFeed:
        """The layer feed of a request's lower-tier chunks: each loads the tokens ``sel``
        (# [k] global positions) does not recompute, past the device prefix."""
        assert self.lower is not None
        placements = []
        for start, end, hit in plan.lower:
            local = sel[(sel >= start) & (sel < end)] - start
            if start < plan.prefix:
                # Cut by the device prefix: its first rows are the prefix's shared slots,
                # never written (left out of the load as if recomputed).
                head = torch.arange(plan.prefix - start, dtype=local.dtype)  # host: planning
                local = torch.unique(torch.cat([head, local.to(head.device)]))
            placements += self.lower.placements(
                hit, plan.pending.token_ids[start:end], start, local
            )
        return LayerFeed(
            self.lower.loader,
            placements,
            self.slots(plan),
            self.kv,
            self.kv.num_layers,
            mode or self.feed_mode,
            timeout_s=self.feed_timeout_s,
        )

    def load_layers(self, plan: RequestPlan, layers: int) -> None:
        """Loads the first ``layers`` layers of the plan's lower-tier chunks whole, in
        order, on this thread (what a pass over the assembled KV reads first)."""
        none = torch.empty(0, dtype=torch.int64)  # host: planning, nothing recomputed
        feed = self.feed(plan, none, mode="inorder")
        try:
            for layer in range(layers):
                feed.before_layer(layer)
        finally:
            feed.close()
        self.count_loaded(feed)

    def load_whole(self, plan: RequestPlan) -> None:
        """Loads the plan's lower-tier chunks whole (every layer) and moves them from
        ``plan.lower`` to ``plan.loaded_whole``: phase 2 feeds nothing more of them, and
        they are still promoted after the batch."""
        if not plan.lower:
            return
        self.load_layers(plan, self.kv.num_layers)
        plan.loaded_whole.extend(plan.lower)
        plan.lower.clear()

    def count_loaded(self, feed: LayerFeed) -> None:
        self.metrics.bytes_loaded.inc(feed.bytes_moved)
        self.metrics.bytes_dense.inc(feed.bytes_dense)
