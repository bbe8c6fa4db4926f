"""Two-phase chunk execution inside SGLang's model forward.

An AROUND hook on the model's forward (``LlamaModel.forward``) sees each extend batch. When
a request in it carries chunk marks, the batch's forward becomes two passes of SGLang's own
layers over the same KV pool:

lookup:  each chunk past the device prefix is looked up in the chunk nodes of the radix
         cache (device tier), then in host memory and on disk. Device hits are copied
         into the request's own slots, re-rotated to the chunk's position (the node stays
         as it was); lower-tier hits are loaded in phase 2.
phase 1: chunks found nowhere run as sub-requests from position 0, each over its own
         slots of the request, so their KV is the independent chunk KV; it is copied into
         new chunk nodes and written through to the host tier (then disk), and its keys
         are re-rotated in place to the chunk's position.
phase 2: the selected tokens (policy, plus fresh and last tokens, minus the device prefix)
         of every chunked request, and all new tokens of plain requests, run in one
         forward; each query attends causally by global position to the assembled KV, and
         its K/V overwrite the reused ones in place. Lower-tier chunks are loaded during
         this forward, layer by layer and only the tokens not recomputed (``LayerFeed``),
         then promoted into chunk nodes.

The rows of tokens not recomputed are zero in the returned hidden states; SGLang's logits
processor reads only each request's last row, which is always recomputed. Requests asking
for input-token logprobs are therefore run as plain requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_pic.config import PicConfig
from sgl_pic.integration.attention import (
    FEEDS_ATTR,
    GROUPS_ATTR,
    PROBE_ATTR,
    AttnGroup,
    DeviationProbe,
    ProbeDone,
)
from sgl_pic.integration.chunk_nodes import ChunkNode, ChunkNodeTable
from sgl_pic.integration.gate import Pending
from sgl_pic.integration.kv_access import KVAccess, single_thread
from sgl_pic.integration.layer_feed import FeedTimeout, LayerFeed, MissingChunkError
from sgl_pic.integration.lower_tiers import LowerHit, LowerTiers
from sgl_pic.integration.metrics import PicMetrics, RequestStats
from sgl_pic.selection import SelectionContext, cachetune_ranking, finalize, make_policy

logger = logging.getLogger(__name__)

# Lower-tier chunks being promoted into chunk nodes at once; more are dropped (counted):
# a promotion only saves a later load, and an unbounded backlog would hold host memory.
MAX_PROMOTIONS = 32


@dataclass
class _Plan:
    """One chunked request of the batch."""

    row_offset: int  # first row of its extend tokens in the batch
    prefix: int  # device prefix length P
    slots: torch.Tensor  # [L] KV slots of the whole prompt
    pending: Pending
    config: PicConfig
    selected: torch.Tensor | None = None  # [k] positions that must be recomputed
    stats: RequestStats | None = None
    rankings: list[torch.Tensor | None] = field(default_factory=list)  # per chunk
    hit_spans: list[tuple[int, int]] = field(default_factory=list)  # chunks reused
    misses: list[tuple[int, int]] = field(default_factory=list)  # chunks for phase 1
    lower: list[tuple[int, int, LowerHit]] = field(default_factory=list)  # host/disk hits
    locked_nodes: list[ChunkNode] = field(default_factory=list)
    locked_keys: list[str] = field(default_factory=list)  # lower-tier records in use
    tiers: set[str] = field(default_factory=set)  # tiers the reused chunks came from


class ChunkExecutor:
    """nodes:  the radix cache's chunk nodes (device tier).
    lower:     host and disk tiers, or None when both are off.
    ratios:    calibrated CacheTune r per tier ("device", "host", "disk"), or None; a
               cachetune request without its own r uses the r of the slowest tier it
               loads from.
    feed_mode: how lower-tier KV is loaded during phase 2 ("threaded" or "inorder").
    feed_timeout_s: longest wait for one layer of lower-tier KV (``FeedTimeout`` past it)."""

    def __init__(
        self,
        settings_config: PicConfig,
        nodes: ChunkNodeTable,
        kv: KVAccess,
        metrics: PicMetrics,
        lower: LowerTiers | None = None,
        ratios: dict[str, float] | None = None,
        feed_mode: str = "threaded",
        feed_timeout_s: float = 30.0,
    ) -> None:
        self.config = settings_config
        self.nodes = nodes
        self.lower = lower
        self.kv = kv
        self.metrics = metrics
        self.ratios = ratios
        self.feed_mode = feed_mode
        self.feed_timeout_s = feed_timeout_s
        # Chunked requests of the batch being forwarded, by SGLang request id: set when the
        # batch is prepared (``plugin._after_prepare_for_extend``), emptied by ``forward``.
        self.handoff: dict[str, Pending] = {}
        self._promoter: ThreadPoolExecutor | None = None
        # chunk token ids -> (full load on the promoter, its ranking, the table's generation)
        self._promoting: dict[tuple[int, ...], tuple[Future[torch.Tensor | None], Any, int]] = {}

    # ----------------------------------------------------------------- entry point
    def forward(
        self,
        run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        input_ids: torch.Tensor,  # [n] extend tokens of the batch
        positions: torch.Tensor,  # [n]
        forward_batch: Any,
        req_to_token: torch.Tensor,  # [max_reqs, max_len] slots of each request
    ) -> torch.Tensor | None:
        """The batch's hidden states # [n, hidden], or None to let SGLang run it as is.

        ``run(ids, pos)`` is SGLang's model forward over the batch as currently described
        by ``forward_batch`` (out_cache_loc and attention groups set by the caller here)."""
        if self._promoting:
            self._finish_promotions()
        handoff, self.handoff = self.handoff, {}
        rids = forward_batch.rids
        if not handoff or rids is None:
            return None
        pool_idx = forward_batch.req_pool_indices.tolist()
        prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
        ext_lens = list(forward_batch.extend_seq_lens_cpu)
        specs: dict[int, tuple[int, int, torch.Tensor, Pending, PicConfig]] = {}
        row = 0
        for b, idx in enumerate(pool_idx):
            pending = handoff.get(rids[b])
            total = prefix_lens[b] + ext_lens[b]
            if pending is not None:
                if total != len(pending.token_ids) or _wants_input_logprobs(forward_batch, b):
                    # A chunked-prefill piece before the last, or logprobs of input tokens
                    # (rows this path leaves zero): run it as SGLang would.
                    logger.warning("sgl_pic: request %s runs without reuse", rids[b])
                    self.metrics.fallbacks.inc()
                else:
                    slots = req_to_token[idx, :total].to(torch.int64)
                    config = pending.request.config(self.config)
                    specs[b] = (row, prefix_lens[b], slots, pending, config)
            row += ext_lens[b]
        if not specs:
            return None

        for attempt in range(2):
            plans = {b: _Plan(*spec) for b, spec in specs.items()}
            t0 = time.perf_counter()
            try:
                with single_thread():
                    self._assemble(plans)
                self._phase1(run, forward_batch, plans)
                t1 = time.perf_counter()
                hidden = self._phase2(
                    run, input_ids, positions, forward_batch, req_to_token, pool_idx, plans
                )
                t2 = time.perf_counter()
                with single_thread():
                    self._promote(plans)
                break
            except MissingChunkError:
                # A host/disk record failed its checks mid-load; the store has counted and
                # dropped it. Every slot the attempt wrote is written again by the next
                # one, where that chunk misses and is recomputed (and stored afresh).
                if attempt:
                    raise
                logger.warning("sgl_pic: a stored chunk went bad while loading; retrying")
                self.metrics.retries.inc()
            except FeedTimeout:
                self.metrics.feed_timeouts.inc()
                raise  # the plugin reruns the batch as exact prefill
            finally:
                self._release(plans)
                if self.lower is not None:
                    self.metrics.record_store_errors(self.lower.store.stats().errors)
                    self.lower.export_stats(self.metrics)
        logger.info(
            "sgl_pic batch: %d chunked request(s), assemble+phase 1 %.3f s, "
            "select+phase 2 %.3f s, recomputed %s",
            len(plans),
            t1 - t0,
            t2 - t1,
            [p.stats.recomputed_tokens for p in plans.values() if p.stats is not None],
        )
        for plan in plans.values():
            assert plan.stats is not None
            self.metrics.record(plan.stats)
        self.metrics.node_tokens.set(self.nodes.allocated_tokens)
        return hidden

    # ----------------------------------------------------------------- phase 1
    def _assemble(self, plans: dict[int, _Plan]) -> None:
        """Looks every chunk up: device hits are copied into their slots, re-rotated;
        host/disk hits are noted for phase 2's layer feed; misses for phase 1."""
        for plan in plans.values():
            toks = plan.pending.token_ids
            layout = plan.pending.request.layout
            device = contiguous = disjoint = reused = 0
            by_tier = {"device": 0, "host": 0, "disk": 0}
            forced: list[torch.Tensor] = []
            rankings = plan.rankings
            seen_miss = False
            for span in layout.chunks:
                if span.end <= plan.prefix:
                    device += 1
                    # Never recomputed (finalize drops the device prefix), so its ranking
                    # cannot matter; a flat one keeps ranking policies total.
                    rankings.append(torch.zeros(span.length))
                    continue
                if span.start < plan.prefix:
                    # Part of the chunk is exact device prefix, part is new: the new part has
                    # no independent KV to borrow (its slots' neighbours are shared), so it
                    # is recomputed whatever the policy says.
                    forced.append(torch.arange(plan.prefix, span.end))
                    seen_miss = True
                    rankings.append(torch.zeros(span.length))
                    continue
                tier = self._lookup(plan, span.start, span.end)
                if tier is None:
                    plan.misses.append((span.start, span.end))
                    seen_miss = True
                    rankings.append(None)
                    continue
                by_tier[tier] += 1
                plan.hit_spans.append((span.start, span.end))
                reused += span.length
                if seen_miss:
                    disjoint += 1
                else:
                    contiguous += 1
            l_cont = _contiguous_hit_length(layout, plan.prefix, plan.hit_spans)
            plan.stats = RequestStats(
                chunks=len(layout.chunks),
                device_prefix_chunks=device,
                contiguous_hits=contiguous,
                disjoint_hits=disjoint,
                misses=0,
                reused_tokens=reused,
                recomputed_tokens=0,
                new_tokens=len(toks) - plan.prefix,
                selection_seconds=0.0,
                device_hits=by_tier["device"],
                host_hits=by_tier["host"],
                disk_hits=by_tier["disk"],
                prefix_hit_tokens=max(plan.prefix, l_cont),
            )
            plan.selected = torch.cat(forced) if forced else torch.empty(0, dtype=torch.int64)

    def _lookup(self, plan: _Plan, start: int, end: int) -> str | None:
        """The tier chunk [start, end) is reused from, or None on a miss. A device hit is
        copied in now; its nodes and a lower hit's records stay locked until the batch
        ends, so nothing the request reads is evicted under it."""
        chunk_ids = plan.pending.token_ids[start:end]
        if chunk_ids in self._promoting:
            # Its full load is already under way: finishing it costs less than loading
            # the chunk again from the lower tier.
            self._finish_promotion(chunk_ids)
        hit = self.nodes.match(chunk_ids)
        if hit is not None:
            self.nodes.lock(hit.nodes)
            plan.locked_nodes.extend(hit.nodes)
            self.kv.write_rotated(plan.slots[start:end], self.kv.read(hit.slots), start)
            plan.rankings.append(hit.ranking)
            plan.tiers.add("device")
            return "device"
        if self.lower is None:
            return None
        lower = self.lower.match(chunk_ids)
        if lower is None:
            return None
        for k in lower.keys:
            if self.lower.store.lock(k.digest):
                plan.locked_keys.append(k.digest)
        plan.lower.append((start, end, lower))
        plan.rankings.append(lower.ranking)
        plan.tiers.add(lower.tier)
        return lower.tier

    def _phase1(self, run: Callable[..., torch.Tensor], fb: Any, plans: dict[int, _Plan]) -> None:
        """Computes the independent KV of missing chunks, stores it, re-rotates it in place."""
        misses = [(plan, s, e) for plan in plans.values() for s, e in plan.misses]
        if misses:
            ids, pos, locs, groups, row = [], [], [], [], 0
            for plan, start, end in misses:
                n = end - start
                ids.append(torch.tensor(plan.pending.token_ids[start:end], dtype=torch.int64))
                pos.append(torch.arange(n))
                slots = plan.slots[start:end]
                locs.append(slots)
                groups.append(AttnGroup(row, row + n, slots, torch.arange(n)))
                row += n
            self._run_phase(run, fb, torch.cat(ids), torch.cat(pos), torch.cat(locs), groups)
            for plan, start, end in misses:
                slots = plan.slots[start:end]
                chunk_ids = plan.pending.token_ids[start:end]
                with single_thread():
                    kv = self.kv.read(slots)  # keys at positions 0..n-1
                # Pre-RoPE keys, once: CacheTune ranks them and the lower tiers store them.
                k_pre = self.kv.pre_rope_keys(kv)
                ranking = cachetune_ranking(k_pre, kv[:, 1], plan.config.cachetune_alpha)
                with single_thread():
                    self._store(chunk_ids, kv, ranking)
                    if self.lower is not None:
                        # Write-through: the host tier then puts it on disk in the background.
                        self.lower.put_chunk(chunk_ids, k_pre, kv[:, 1], ranking)
                    self.kv.write_rotated(slots, kv, start)
                i = next(
                    j for j, s in enumerate(plan.pending.request.layout.chunks) if s.start == start
                )
                plan.rankings[i] = ranking
                assert plan.stats is not None
                plan.stats = plan.stats._replace(misses=plan.stats.misses + 1)

    def _store(
        self,
        chunk_ids: tuple[int, ...],
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim], K at 0..n-1
        ranking: torch.Tensor | None,  # [n]
    ) -> None:
        """New chunk nodes for the segments not held, when the pool share has room."""
        inserted = self.nodes.insert(chunk_ids, ranking) if self.nodes.capacity_tokens else ()
        if inserted is None:
            self.metrics.node_insert_failures.inc()
        elif inserted:
            for node, key in zip(*inserted, strict=True):
                self.kv.write_rotated(node.kv_slots, kv[:, :, key.start : key.end], 0)

    # ----------------------------------------------------------------- phase 2
    def _phase2(
        self,
        run: Callable[..., torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        fb: Any,
        req_to_token: torch.Tensor,
        pool_idx: list[int],
        plans: dict[int, _Plan],
    ) -> torch.Tensor:
        prefix_lens = list(fb.extend_prefix_lens_cpu)
        ext_lens = list(fb.extend_seq_lens_cpu)
        ids, pos, locs, groups, rows = [], [], [], [], []
        feeds: list[LayerFeed] = []
        row_in, row_out = 0, 0
        for b, idx in enumerate(pool_idx):
            p, e = prefix_lens[b], ext_lens[b]
            plan = plans.get(b)
            if plan is None:
                sel_rows = torch.arange(row_in, row_in + e)
                key_slots = req_to_token[idx, : p + e].to(torch.int64)
                q_pos = positions[row_in : row_in + e].to(torch.int64)
            else:
                sel = self._select(plan, lambda plan=plan: self._deviation(run, fb, plan))
                sel_rows = plan.row_offset + (sel - plan.prefix)
                key_slots = plan.slots
                q_pos = sel
                if plan.lower:
                    feeds.append(self._feed(plan, sel))
            n = sel_rows.numel()
            ids.append(input_ids[sel_rows])
            pos.append(positions[sel_rows])
            locs.append(fb.out_cache_loc[sel_rows])
            groups.append(AttnGroup(row_out, row_out + n, key_slots, q_pos))
            rows.append(sel_rows)
            row_in += e
            row_out += n
        for feed in feeds:
            feed.start()
        setattr(fb, FEEDS_ATTR, feeds)
        try:
            out = self._run_phase(run, fb, torch.cat(ids), torch.cat(pos), torch.cat(locs), groups)
        finally:
            setattr(fb, FEEDS_ATTR, None)
            for feed in feeds:
                feed.close()
        for feed in feeds:
            if not feed.done:
                raise RuntimeError("phase 2 ended before every layer's reused KV was loaded")
            self._count_loaded(feed)
        hidden = out.new_zeros((input_ids.shape[0], out.shape[-1]))
        hidden[torch.cat(rows)] = out
        return hidden

    def _select(self, plan: _Plan, deviation: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Global positions recomputed for this request (# [k] int64, sorted, >= prefix).
        ``deviation()`` runs CacheBlend's online pass; only policies needing it call it."""
        t0 = time.perf_counter()
        layout = plan.pending.request.layout
        plan.config = self._calibrated(plan)
        policy = make_policy(plan.config)
        ctx = SelectionContext(layout, tuple(plan.rankings), deviation, plan.prefix)
        chosen = finalize(policy.select(ctx), layout, plan.prefix).indices
        assert plan.selected is not None
        sel = torch.unique(torch.cat([chosen, plan.selected]))
        sel = sel[sel >= plan.prefix]
        assert plan.stats is not None
        plan.stats = plan.stats._replace(
            recomputed_tokens=int(sel.numel()),
            reused_tokens=plan.stats.reused_tokens - _count_in(sel, plan.hit_spans),
            selection_seconds=time.perf_counter() - t0,
        )
        return sel

    def _deviation(self, run: Callable[..., torch.Tensor], fb: Any, plan: _Plan) -> torch.Tensor:
        """CacheBlend's online signal # [prompt_len]: every token past the device prefix runs
        layer 0 against the assembled KV, and its layer-1 K/V are compared with the reused
        ones. Needs every reused token in the pool first, so lower-tier chunks are loaded
        whole here (CacheBlend compares against all of them) instead of sparsely later."""
        if plan.lower:
            # Loaded here, before any forward pulls it: in order, on this thread.
            feed = self._feed(plan, torch.empty(0, dtype=torch.int64), mode="inorder")
            for layer in range(self.kv.num_layers):
                feed.before_layer(layer)
            self._count_loaded(feed)
            plan.lower.clear()
        toks = plan.pending.token_ids
        n = len(toks)
        pos = torch.arange(plan.prefix, n)
        slots = plan.slots[plan.prefix :]
        probe = DeviationProbe(slots)
        setattr(fb, PROBE_ATTR, probe)
        try:
            self._run_phase(
                run,
                fb,
                torch.tensor(toks[plan.prefix :], dtype=torch.int64),
                pos,
                slots,
                [AttnGroup(0, n - plan.prefix, plan.slots, pos)],
            )
        except ProbeDone:
            pass
        finally:
            setattr(fb, PROBE_ATTR, None)
        if probe.deviation is None:
            raise RuntimeError("the deviation pass ended without reaching layer 1")
        dev = torch.zeros(n)
        dev[plan.prefix :] = probe.deviation.cpu()
        fresh = plan.pending.request.layout.fresh_indices()
        dev[torch.tensor(fresh, dtype=torch.int64)] = 0.0
        return dev

    def _count_loaded(self, feed: LayerFeed) -> None:
        self.metrics.bytes_loaded.inc(feed.bytes_moved)
        self.metrics.bytes_dense.inc(feed.bytes_dense)

    def _calibrated(self, plan: _Plan) -> PicConfig:
        """The request's config with CacheTune's r set to the calibrated r of the slowest
        tier it reuses from, unless calibration is off or the request chose its own r."""
        if (
            self.ratios is None
            or plan.config.policy != "cachetune"
            or "cachetune_r" in plan.pending.request.overrides
        ):
            return plan.config
        tier = next((t for t in ("disk", "host", "device") if t in plan.tiers), None)
        if tier is None or tier not in self.ratios:
            return plan.config
        return plan.config.with_overrides(cachetune_r=self.ratios[tier])

    def _feed(self, plan: _Plan, sel: torch.Tensor, mode: str | None = None) -> LayerFeed:
        """The layer feed of a request's lower-tier chunks: each loads the tokens ``sel``
        (# [k] global positions) does not recompute."""
        assert self.lower is not None
        placements = []
        for start, end, hit in plan.lower:
            local = sel[(sel >= start) & (sel < end)] - start
            placements += self.lower.placements(
                hit, plan.pending.token_ids[start:end], start, local
            )
        return LayerFeed(
            self.lower.loader,
            placements,
            plan.slots,
            self.kv,
            self.kv.num_layers,
            mode or self.feed_mode,
            timeout_s=self.feed_timeout_s,
        )

    def _promote(self, plans: dict[int, _Plan]) -> None:
        """Lower-tier chunks the request used become chunk nodes, so the next request finds
        them on the device. The full read and rotation run on a worker, off the request's
        path; the nodes are filled on this (the scheduler's) thread by the next batch."""
        if self.lower is None or self.nodes.capacity_tokens == 0:
            return
        lower = self.lower
        for plan in plans.values():
            for start, end, hit in plan.lower:
                chunk_ids = plan.pending.token_ids[start:end]
                if chunk_ids in self._promoting or self.nodes.match(chunk_ids) is not None:
                    continue
                if len(self._promoting) >= MAX_PROMOTIONS:
                    self.metrics.queue_drops.labels(queue="promotion").inc()
                    continue
                if self._promoter is None:
                    self._promoter = ThreadPoolExecutor(1, thread_name_prefix="sgl-pic-promote")
                job = self._promoter.submit(lower.load_full, hit, chunk_ids)
                self._promoting[chunk_ids] = (job, hit.ranking, self.nodes.generation)

    def _finish_promotions(self) -> None:
        """Fills chunk nodes with the promotions whose load has completed."""
        for chunk_ids, (job, _, _) in list(self._promoting.items()):
            if job.done():
                self._finish_promotion(chunk_ids)

    def _finish_promotion(self, chunk_ids: tuple[int, ...]) -> None:
        """Waits for one promotion's load and fills its chunk nodes (unless a flush came
        in between, or the load found the records gone)."""
        job, ranking, generation = self._promoting.pop(chunk_ids)
        if generation != self.nodes.generation:
            # Begun before a flush, which dropped the chunk nodes: never waited for.
            job.cancel()
            return
        try:
            kv = job.result()
        except Exception:  # noqa: BLE001 - a failed promotion only loses the speed-up
            logger.exception("sgl_pic: promotion of a stored chunk failed")
            return
        if kv is not None and self.nodes.match(chunk_ids) is None:
            with single_thread():
                self._store(chunk_ids, kv, ranking)
            self.metrics.promotions.inc()

    def _release(self, plans: dict[int, _Plan]) -> None:
        for plan in plans.values():
            self.nodes.unlock(plan.locked_nodes)
            plan.locked_nodes.clear()
            if self.lower is not None:
                for key in plan.locked_keys:
                    self.lower.store.unlock(key)
            plan.locked_keys.clear()

    @staticmethod
    def _run_phase(
        run: Callable[..., torch.Tensor],
        fb: Any,
        ids: torch.Tensor,  # [m]
        pos: torch.Tensor,  # [m]
        locs: torch.Tensor,  # [m]
        groups: list[AttnGroup],
    ) -> torch.Tensor:
        saved = fb.out_cache_loc
        fb.out_cache_loc = locs.to(saved.dtype)
        setattr(fb, GROUPS_ATTR, groups)
        try:
            return run(ids.to(saved.device), pos.to(saved.device))
        finally:
            fb.out_cache_loc = saved
            setattr(fb, GROUPS_ATTR, None)


def _wants_input_logprobs(fb: Any, b: int) -> bool:
    """Whether request ``b`` needs logits of input rows other than its last one."""
    if not getattr(fb, "return_logprob", False):
        return False
    starts = getattr(fb, "extend_logprob_start_lens_cpu", None)
    if starts is None:
        return True
    return int(starts[b]) < int(fb.extend_seq_lens_cpu[b]) - 1


def _contiguous_hit_length(layout: Any, prefix: int, hits: list[tuple[int, int]]) -> int:
    """DARIC's L_cont: how far from position 0 the prompt is covered by the device prefix
    and reused chunks without a gap (fresh text or a missed chunk ends it)."""
    end = prefix
    for start, stop in sorted(hits):
        if start > end:
            break
        end = max(end, stop)
    return end if end > prefix else 0


def _count_in(sel: torch.Tensor, spans: list[tuple[int, int]]) -> int:
    """How many of the positions ``sel`` (# [k]) lie in the half-open ``spans``."""
    inside = torch.zeros_like(sel, dtype=torch.bool)
    for start, end in spans:
        inside |= (sel >= start) & (sel < end)
    return int(inside.sum())
