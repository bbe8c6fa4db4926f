"""The chunk path's plan for one request, without SGLang or a KV pool.

Planning is host-side bookkeeping, like SGLang's own ``*_cpu`` lists: which chunks are
device prefix, hits (and from which tier) or misses; the DARIC hit classification
(contiguous vs disjoint, L_hit); the policy's selection refined by the device prefix
(DARIC Proposition 1); the runs phase 2 executes. Everything here is pure given the
lookup results, so it is unit-tested without a server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.core.metrics import RequestStats
from sgl_pic.layout import PromptLayout
from sgl_pic.selection import SelectionContext, finalize, make_policy

# Fastest first: a request's slowest tier is the last of these it reuses from.
TIERS = ("device", "host", "disk", "shared")


@dataclass
class RequestPlan:
    """One chunked request of the batch, filled in as the forward goes."""

    row_offset: int  # first row of its extend tokens in the live batch
    pool_idx: int  # its row of SGLang's req_to_token
    prefix: int  # device prefix length P
    pending: Pending
    config: PicConfig
    # Where this batch's extend of it ends (None: its whole prompt); less than the prompt
    # for the first of several prefill pieces, planned whole (``pieces``).
    piece_end: int | None = None
    forced: torch.Tensor | None = None  # [f] positions recomputed whatever the policy says
    selected: torch.Tensor | None = None  # [k] positions phase 2 recomputes
    stats: RequestStats | None = None
    rankings: list[torch.Tensor | None] = field(default_factory=list)  # per chunk
    hit_spans: list[tuple[int, int]] = field(default_factory=list)  # chunks reused
    misses: list[tuple[int, int]] = field(default_factory=list)  # chunks for phase 1
    # Misses store admission did not store: computed in context, as fresh text.
    deferred: list[tuple[int, int]] = field(default_factory=list)
    lower: list[tuple[int, int, Any]] = field(default_factory=list)  # host/disk hits
    # Host/disk hits already loaded whole (CacheBlend's pass needs them all in the pool).
    loaded_whole: list[tuple[int, int, Any]] = field(default_factory=list)
    locked_nodes: list[Any] = field(default_factory=list)
    locked_keys: list[str] = field(default_factory=list)  # lower-tier records in use
    tiers: set[str] = field(default_factory=set)  # tiers the reused chunks came from
    runs: int = 0  # contiguous runs phase 2 executes as sub-requests
    fresh_layout: PromptLayout | None = None  # the layout with deferred chunks as fresh text

    @property
    def layout(self) -> PromptLayout:
        """The layout selection and the phases work from: the request's, with the chunks
        store admission deferred turned into fresh text (nothing of theirs is reused, so
        every token of theirs is computed). ``classify`` sets it; ``rankings`` follow it."""
        return self.fresh_layout or self.pending.request.layout

    @property
    def num_tokens(self) -> int:
        return len(self.pending.token_ids)

    @property
    def first_piece(self) -> bool:
        """Whether this batch runs only its first prefill piece (``pieces``)."""
        return self.piece_end is not None and self.piece_end < self.num_tokens


class ChunkLookup(NamedTuple):
    """Where chunk [start, end) is reused from: a tier name, or None on a miss, plus its
    stored ranking (# [end - start], None when the store has none). ``admit``: on a miss,
    whether phase 1 encodes and stores it (False: it is computed in context instead)."""

    tier: str | None
    ranking: torch.Tensor | None
    admit: bool = True


def classify(
    plan: RequestPlan,
    lookup: Callable[[int, int], ChunkLookup],
    lookup_tail: Callable[[int, int, int], ChunkLookup] | None = None,
) -> None:
    """Fills the plan's rankings, hits, misses, deferred chunks, forced positions and
    stats. ``lookup`` is called once per chunk past the device prefix, in prompt order;
    ``lookup_tail(start, end, prefix)`` once for the chunk the device prefix ends inside,
    whose positions from the prefix on are reused from a stored copy (a hit) or from the
    chunk encoded whole by phase 1 (an admitted miss), else recomputed (a miss not
    admitted, or no ``lookup_tail``). A whole miss not admitted is deferred: forced, and
    fresh text in ``plan.layout`` from here on."""
    layout = plan.pending.request.layout
    counts = _classify_chunks(plan, lookup, lookup_tail)
    plan.stats = _request_stats(plan, counts)
    if plan.deferred:
        kept = tuple(s for s in layout.chunks if (s.start, s.end) not in plan.deferred)
        plan.fresh_layout = PromptLayout(layout.num_tokens, kept)
    none = torch.empty(0, dtype=torch.int64)  # host: planning
    plan.forced = torch.cat(counts.forced) if counts.forced else none


class _ChunkCounts(NamedTuple):
    """What ``_classify_chunks`` counted over a request's chunks."""

    device: int  # chunks inside the device prefix
    contiguous: int  # hits before the first miss
    disjoint: int  # hits after a miss
    reused: int  # tokens of hits past the device prefix
    by_tier: dict[str, int]  # hits per tier (every name of TIERS)
    forced: list[torch.Tensor]  # each [m] int64 positions recomputed whatever the policy says


def _classify_chunks(
    plan: RequestPlan,
    lookup: Callable[[int, int], ChunkLookup],
    lookup_tail: Callable[[int, int, int], ChunkLookup] | None,
) -> _ChunkCounts:
    """Looks up each chunk of the request's layout in prompt order (``classify``'s
    contract) and appends to the plan's rankings (one per chunk), hit spans, misses,
    deferred chunks and tiers; returns the counts and the forced position ranges."""
    device = contiguous = disjoint = reused = 0
    by_tier = dict.fromkeys(TIERS, 0)
    forced: list[torch.Tensor] = []
    seen_miss = False
    for span in plan.pending.request.layout.chunks:
        if span.end <= plan.prefix:
            device += 1
            # Never recomputed (finalize drops the device prefix), so its ranking cannot
            # matter; a flat one keeps ranking policies total.
            plan.rankings.append(torch.zeros(span.length))  # host: planning
            continue
        start = max(span.start, plan.prefix)
        hit = _lookup_chunk(span.start, span.end, plan.prefix, lookup, lookup_tail)
        if hit is None or (hit.tier is None and not hit.admit):
            # Recomputed in context: a tail with no copy, or a miss not admitted (deferred
            # when whole, else its ranking is flat like a device-prefix chunk's).
            forced.append(torch.arange(start, span.end))  # host: planning
            if hit is not None and start == span.start:
                plan.deferred.append((span.start, span.end))
            else:
                plan.rankings.append(torch.zeros(span.length))  # host: planning
            seen_miss = True
            continue
        plan.rankings.append(hit.ranking)
        if hit.tier is None:
            plan.misses.append((span.start, span.end))
            seen_miss = True
            continue
        by_tier[hit.tier] += 1
        plan.tiers.add(hit.tier)
        plan.hit_spans.append((start, span.end))
        reused += span.end - start
        if seen_miss:
            disjoint += 1
        else:
            contiguous += 1
    return _ChunkCounts(device, contiguous, disjoint, reused, by_tier, forced)


def _lookup_chunk(
    start: int,
    end: int,
    prefix: int,
    lookup: Callable[[int, int], ChunkLookup],
    lookup_tail: Callable[[int, int, int], ChunkLookup] | None,
) -> ChunkLookup | None:
    """Where chunk [start, end), which ends past the device prefix, is reused from; None
    for a chunk the prefix ends inside when there is no ``lookup_tail``."""
    if start >= prefix:
        return lookup(start, end)
    # Part device prefix, part new: SGLang's radix cache matched the chunk's first tokens
    # (text that other prompts share there, such as a "Passage:" label, or the prefix
    # ended at a page boundary). The rest is the chunk's KV from a copy (device, host or
    # disk) when it has one; a miss store admission takes is encoded whole by phase 1
    # apart from the prefix's shared slots, stored, and its rows from the prefix on
    # reused (``misses`` then starts before the prefix).
    return lookup_tail(start, end, prefix) if lookup_tail else None


def _request_stats(plan: RequestPlan, counts: _ChunkCounts) -> RequestStats:
    """The plan's stats after classification (nothing selected or recomputed yet)."""
    l_cont = contiguous_hit_length(plan.prefix, plan.hit_spans)
    return RequestStats(
        chunks=len(plan.pending.request.layout.chunks),
        device_prefix_chunks=counts.device,
        contiguous_hits=counts.contiguous,
        disjoint_hits=counts.disjoint,
        misses=0,
        reused_tokens=counts.reused,
        recomputed_tokens=0,
        new_tokens=plan.num_tokens - plan.prefix,
        selection_seconds=0.0,
        device_hits=counts.by_tier["device"],
        host_hits=counts.by_tier["host"],
        disk_hits=counts.by_tier["disk"],
        shared_hits=counts.by_tier["shared"],
        prefix_hit_tokens=max(plan.prefix, l_cont),
        deferred=len(plan.deferred),
    )


class Signals(Protocol):
    """The online signals a policy may read of a plan, each # [prompt_len] over the
    assembled KV: CacheBlend's deviation and the query-aware score. Computed only when a
    policy asks (``signals.BatchSignals`` of the executor's batch; tests give arrays)."""

    def deviation(self, plan: RequestPlan) -> torch.Tensor: ...

    def query_attention(self, plan: RequestPlan) -> torch.Tensor: ...


def select(
    plan: RequestPlan,
    signals: Signals,
    ratios: dict[str, float] | None = None,
) -> torch.Tensor:
    """Global positions phase 2 recomputes (# [k] int64, sorted, all >= prefix): the
    policy's choice, finalised (fresh tokens, the last token), plus the forced ones.
    Only policies that need a signal read it from ``signals`` (inside the timed selection;
    the executor runs the query probe for all of a batch's requests at once beforehand,
    and adds that pass's time to the selection's)."""
    t0 = time.perf_counter()
    plan.config = calibrated(plan, ratios)
    policy = make_policy(plan.config)
    ctx = SelectionContext(
        plan.layout,
        tuple(plan.rankings),
        lambda: signals.deviation(plan),
        plan.prefix,
        lambda: signals.query_attention(plan),
    )
    chosen = finalize(policy.select(ctx), plan.layout, plan.prefix).indices
    assert plan.forced is not None and plan.stats is not None
    sel = torch.unique(torch.cat([chosen, plan.forced]))
    sel = sel[sel >= plan.prefix]
    plan.selected = sel
    plan.stats = plan.stats._replace(
        recomputed_tokens=int(sel.numel()),
        reused_tokens=plan.stats.reused_tokens - count_in(sel, plan.hit_spans),
        selection_seconds=time.perf_counter() - t0,
    )
    return sel


def calibrated(plan: RequestPlan, ratios: dict[str, float] | None) -> PicConfig:
    """The request's config with CacheTune's r set to the calibrated r of the slowest
    tier it reuses from, unless calibration is off or the request chose its own r. The
    shared tier has no calibrated r of its own (start-up calibration cannot count on the
    store being reachable); it takes the disk tier's, the slowest one measured."""
    if (
        ratios is None
        or plan.config.policy != "cachetune"
        or "cachetune_r" in plan.pending.request.overrides
    ):
        return plan.config
    tier = next((t for t in reversed(TIERS) if t in plan.tiers), None)
    if tier == "shared" and "shared" not in ratios:
        tier = "disk"
    if tier is None or tier not in ratios:
        return plan.config
    return plan.config.with_overrides(cachetune_r=ratios[tier])


def pool_rows(fb: Any) -> list[int]:
    """The request-table rows of the live batch's requests, in batch order. SGLang keeps
    a host copy of them for extend batches (``ForwardBatch.req_pool_indices_cpu``); the
    device tensor is read (a sync that stalls SGLang's overlap scheduler) only when a
    batch comes without one."""
    rows = getattr(fb, "req_pool_indices_cpu", None)
    if rows is None:
        rows = fb.req_pool_indices
    return [int(r) for r in rows.tolist()]


def contiguous_hit_length(prefix: int, hits: list[tuple[int, int]]) -> int:
    """DARIC's L_cont: how far from position 0 the prompt is covered by the device prefix
    and reused chunks without a gap (fresh text or a missed chunk ends it)."""
    end = prefix
    for start, stop in sorted(hits):
        if start > end:
            break
        end = max(end, stop)
    return end if end > prefix else 0


def count_in(sel: torch.Tensor, spans: list[tuple[int, int]]) -> int:
    """How many of the positions ``sel`` (# [k]) lie in the half-open ``spans``."""
    inside = torch.zeros_like(sel, dtype=torch.bool)
    for start, end in spans:
        inside |= (sel >= start) & (sel < end)
    return int(inside.sum())
