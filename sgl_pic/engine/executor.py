"""Two-phase chunk execution of one extend batch, as SGLang-native phase batches.

The runner's decoder stack hands the executor every extend batch (``model_hooks``). When
requests in it carry verified chunk marks, the batch becomes phase forwards over the same
KV pool, each an ordinary extend batch planned by the selected attention backend
(``phases``):

lookup:  each chunk past the device prefix is looked up in the chunk nodes (device tier),
         then host memory and disk. Device hits are copied into the request's own slots
         and re-rotated to the chunk's position (the node stays as it was); lower-tier
         hits are loaded during phase 2.
admission: a chunk found nowhere is stored, or, when store admission defers it
         (``sgl_pic.store.admission``: seen for the first time in a stream where first
         sights seldom come back), computed in context in phase 2 like fresh text.
phase 1: chunks found nowhere and admitted run as sub-requests from position 0 over their own slots
         (scratch rows of SGLang's request table), so their KV is the independent chunk
         KV; it is copied into new chunk nodes, written through to the host tier, and its
         keys are re-rotated in place to the chunk's position.
phase 2: each chunked request's selected positions (``planner.select``) as contiguous
         runs, each a sub-request over the request's own row, plus every plain request of
         the batch as itself, in one forward. Lower-tier chunks are loaded during it,
         layer by layer and only the tokens not recomputed (``LayerFeed``), then promoted.

Rows of tokens not recomputed are zero in the returned hidden states; SGLang's logits
processor reads only each request's last row, which is always recomputed. Requests asking
for input-token logprobs therefore run as plain requests (and requests for every row's hidden
state never reach here: the gate runs them exact).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from sgl_pic.binding.attention import DeviationProbe, ProbeDone
from sgl_pic.binding.gate import Pending
from sgl_pic.binding.metrics import PicMetrics
from sgl_pic.binding.phases import (
    PhaseBatch,
    PhaseRunner,
    Run,
    SubRequest,
    attended_keys,
    runs_of,
)
from sgl_pic.config import PicConfig
from sgl_pic.engine import planner
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.kv_access import KVAccess, single_thread
from sgl_pic.engine.layer_feed import FeedTimeout, LayerFeed, MissingChunkError
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.planner import ChunkLookup, RequestPlan
from sgl_pic.engine.promoter import Promoter
from sgl_pic.engine.query_probe import ProbeCut, QueryProbe, host_scores
from sgl_pic.selection import cachetune_ranking, make_policy
from sgl_pic.selection.query_aware import query_positions
from sgl_pic.store.admission import BatchAdmission, StoreAdmission

logger = logging.getLogger(__name__)

# Scratch rows phase 1 takes from SGLang's request table at once; more misses run in
# further rounds.
MAX_SCRATCH_ROWS = 16

Stack = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class HitCopy(NamedTuple):
    """One device hit's copy: the chunk node's slots from the first row past the device
    prefix, the request's slots they go to, and the positions its keys move by (the
    chunk's start: node keys sit at chunk positions 0..n-1)."""

    src: torch.Tensor  # [n] node slots
    dst: torch.Tensor  # [n] request slots
    delta: int


class NoScratchRows(RuntimeError):
    """SGLang's request table has no free row for phase 1 (the batch runs exact)."""


class ChunkExecutor:
    """nodes:  the radix cache's chunk nodes (device tier).
    phases:    runs phase batches through SGLang's backend and the decoder stack.
    lower:     host and disk tiers, or None when both are off.
    ratios:    calibrated CacheTune r per tier ("device", "host", "disk"), or None.
    feed_mode: how lower-tier KV is loaded during phase 2 ("threaded" or "inorder").
    feed_timeout_s: longest wait for one layer of lower-tier KV (``FeedTimeout`` past it).
    merge_gap: phase-2 runs separated by at most this many tokens are merged.
    admission: whether a chunk found nowhere is stored (phase 1) or computed in context;
               None stores every one.
    reduce:    sums a device tensor over the tensor-parallel ranks, so that signals computed
               from each rank's own heads (CacheBlend's deviation, the query probe) select
               the same tokens everywhere; None on one rank.
    sync_deletions: applies the deletion orders other servers sharing the store issued
               to the chunk nodes (``Deleter.sync``); called before each batch's lookups,
               so a chunk deleted anywhere is not found here afterwards. None: nothing to
               sync."""

    def __init__(
        self,
        settings_config: PicConfig,
        nodes: ChunkNodeTable,
        kv: KVAccess,
        metrics: PicMetrics,
        phases: PhaseRunner,
        lower: LowerTiers | None = None,
        ratios: dict[str, float] | None = None,
        feed_mode: str = "threaded",
        feed_timeout_s: float = 30.0,
        merge_gap: int = 0,
        admission: StoreAdmission | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        sync_deletions: Callable[[], object] | None = None,
    ) -> None:
        self.config = settings_config
        self.sync_deletions = sync_deletions
        self.nodes = nodes
        self.lower = lower
        self.kv = kv
        self.metrics = metrics
        self.phases = phases
        self.ratios = ratios
        self.feed_mode = feed_mode
        self.feed_timeout_s = feed_timeout_s
        self.merge_gap = merge_gap
        self.admission = admission
        self._batch_admission = BatchAdmission(None)  # the batch under way's (``forward``)
        self.reduce = reduce
        self.promoter = Promoter(
            nodes,
            (lambda hit, ids: lower.load_full(hit, ids)) if lower is not None else _no_load,
            self._store_locked,
            metrics,
        )

    # ----------------------------------------------------------------- entry point
    def forward(
        self,
        stack: Stack,
        input_ids: torch.Tensor,  # [n] extend tokens of the live batch
        live: Any,  # the ForwardBatch SGLang built
        handoff: Mapping[str, Pending],
    ) -> torch.Tensor | None:
        """The batch's hidden states # [n, hidden], or None to let SGLang run it as is.
        ``stack(ids, pos, fb)`` is the decoder stack's own forward; ``handoff`` the verified
        marks of the batch's chunked requests by request id (``PicRuntime.prepare_batch``)."""
        if len(self.promoter):
            self.promoter.finish_ready()
        rids = live.rids
        if not handoff or rids is None:
            return None
        pool_idx = planner.pool_rows(live)
        prefix_lens = list(live.extend_prefix_lens_cpu)
        ext_lens = list(live.extend_seq_lens_cpu)
        specs: dict[int, tuple[int, int, int, Pending, PicConfig]] = {}
        row = 0
        for b, idx in enumerate(pool_idx):
            pending = handoff.get(rids[b])
            total = prefix_lens[b] + ext_lens[b]
            if pending is not None:
                if total > len(pending.token_ids):
                    # SGLang retracted it under KV pressure (``retract_decode``) and now
                    # prefills its prompt and the output so far again: its prompt's KV comes
                    # from its own namespace of the prefix tree where still held, the rest
                    # is computed as SGLang would. Not a fallback: the prompt was served.
                    logger.info("sgl_pic: request %s resumes after a retraction", rids[b])
                    self.metrics.resumed.inc()
                elif total != len(pending.token_ids) or planner.wants_input_logprobs(live, b):
                    # A chunked-prefill piece before the last, or logprobs of input tokens
                    # (rows this path leaves zero): run it as SGLang would.
                    logger.warning("sgl_pic: request %s runs without reuse", rids[b])
                    self.metrics.fallbacks.inc()
                else:
                    config = pending.request.config(self.config)
                    specs[b] = (row, idx, prefix_lens[b], pending, config)
            row += ext_lens[b]
        if not specs:
            return None
        if self.sync_deletions is not None:
            self.sync_deletions()

        self._batch_admission = BatchAdmission(self.admission)
        try:
            hidden = self._attempts(stack, input_ids, live, specs)
            self.metrics.node_tokens.set(self.nodes.allocated_tokens)
            if self.admission is not None:
                self.metrics.admission_reuse_rate.set(self.admission.reuse_rate)
            evictions = {"device": self.nodes.evicted_nodes}
            if self.lower is not None:
                evictions["host"] = self.lower.store.host.stats().evictions
                evictions["disk"] = self.lower.store.disk.stats().evictions
            self.metrics.record_evictions(evictions)
            self.export_namespace_sizes()
        except BaseException:
            self._batch_admission.abandon()  # the plugin reruns it as plain prefill
            raise
        finally:
            self._batch_admission = BatchAdmission(None)
        return hidden

    def _attempts(
        self,
        stack: Stack,
        input_ids: torch.Tensor,  # [n] extend tokens of the live batch
        live: Any,
        specs: dict[int, tuple[int, int, int, Pending, PicConfig]],
    ) -> torch.Tensor:
        """Runs the batch's chunked requests, a second time if a stored chunk goes bad
        mid-load; # [n, hidden]."""
        for attempt in range(2):
            plans = {b: RequestPlan(*spec) for b, spec in specs.items()}
            t0 = time.perf_counter()
            try:
                with single_thread():
                    self._assemble(plans)
                self._phase1(stack, live, plans)
                t1 = time.perf_counter()
                hidden = self._phase2(stack, input_ids, live, plans)
                t2 = time.perf_counter()
                with single_thread():
                    self._promote(plans)
                break
            except MissingChunkError:
                # A host/disk record failed its checks mid-load; the store has counted and
                # dropped it. Every slot the attempt wrote is written again by the next
                # one, where that chunk misses and, admitted as the stored chunk it was in
                # this attempt, is recomputed and stored afresh.
                if attempt:
                    raise
                logger.warning("sgl_pic: a stored chunk went bad while loading; retrying")
                self.metrics.retries.inc()
                self._batch_admission.retry()
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
            "select+phase 2 %.3f s, recomputed %s in %s run(s)",
            len(plans),
            t1 - t0,
            t2 - t1,
            [p.stats.recomputed_tokens for p in plans.values() if p.stats is not None],
            [p.runs for p in plans.values()],
        )
        for plan in plans.values():
            assert plan.stats is not None
            self.metrics.record(plan.stats)
            self.metrics.record_namespace(plan.pending.namespace, plan.stats)
        return hidden

    def export_namespace_sizes(self) -> None:
        """Per-namespace chunk-node slots and host/disk bytes into the metrics, where the
        operator enabled per-namespace metrics."""
        if not self.metrics.namespace_labels.limit:
            return
        tiers: dict[str, dict[str, int]] = {}
        if self.lower is not None:
            tiers["host"] = self.lower.store.host.bytes_by_namespace()
            tiers["disk"] = self.lower.store.disk.bytes_by_namespace()
        self.metrics.record_namespace_sizes(self.nodes.tokens_by_namespace(), tiers)

    def close(self) -> None:
        """Joins the promoter's worker (shutdown)."""
        self.promoter.close()

    # ----------------------------------------------------------------- lookup
    def _slots(self, plan: RequestPlan, start: int = 0, end: int | None = None) -> torch.Tensor:
        """# [end - start] pool slots of the request's positions start..end-1."""
        stop = plan.num_tokens if end is None else end
        return self.phases.req_to_token[plan.pool_idx, start:stop].to(torch.int64)

    def _assemble(self, plans: dict[int, RequestPlan]) -> None:
        """Looks every chunk up, then copies all device hits of the batch in one call."""
        copies: list[HitCopy] = []
        for plan in plans.values():
            planner.classify(
                plan,
                lambda s, e, plan=plan: self._lookup(plan, s, e, copies),
                lambda s, e, keep, plan=plan: self._lookup(plan, s, e, copies, keep),
            )
        if copies:
            device = self.kv.device
            self.kv.copy_rotated(
                torch.cat([c.src.to(device) for c in copies]),
                torch.cat([c.dst.to(device) for c in copies]),
                torch.cat([torch.full((c.src.numel(),), c.delta, device=device) for c in copies]),
            )

    def _lookup(
        self,
        plan: RequestPlan,
        start: int,
        end: int,
        copies: list[HitCopy],
        keep: int | None = None,
    ) -> ChunkLookup:
        """Where chunk [start, end) is reused from. A device hit's copy into the request's
        slots is added to ``copies`` (``_assemble`` makes them before phase 1); its nodes
        and a lower hit's records stay locked until the batch ends, so nothing the request
        reads is evicted under it. ``keep``: when the device prefix ends inside the chunk,
        its first position past the prefix; only a device copy serves then (its rows from
        ``keep`` on; the prefix's slots are shared and stay as they are), since host and
        disk loads place whole chunks. A miss says whether store admission lets phase 1
        store it."""
        keep = start if keep is None else keep
        chunk_ids = plan.pending.token_ids[start:end]
        # Only the request's own namespace and the public ones it may read, own first
        # (``gate.Pending``): no lookup of any tier crosses into another tenant's chunks.
        readable = plan.pending.readable
        for ns in readable:
            if (ns, chunk_ids) in self.promoter:
                # Its full load is already under way: finishing it costs less than loading
                # the chunk again from the lower tier.
                self.promoter.finish((ns, chunk_ids), self.feed_timeout_s)
        hit = next(
            (h for ns in readable if (h := self.nodes.match(chunk_ids, ns)) is not None), None
        )
        if hit is not None:
            self._sighted(plan, chunk_ids, stored=True)
            self.nodes.lock(hit.nodes)
            plan.locked_nodes.extend(hit.nodes)
            # Rows keep - start.. hold keys at those chunk positions: moving them by
            # ``start`` puts them at keep..end-1.
            copies.append(HitCopy(hit.slots[keep - start :], self._slots(plan, keep, end), start))
            return ChunkLookup("device", hit.ranking)
        if keep > start:
            return ChunkLookup(None, None)  # recomputed in context whatever admission says
        lower = None
        if self.lower is not None:
            lower = next(
                (h for ns in readable if (h := self.lower.match(chunk_ids, ns)) is not None),
                None,
            )
        if lower is None:
            return ChunkLookup(None, None, self._sighted(plan, chunk_ids, stored=False))
        assert self.lower is not None
        self._sighted(plan, chunk_ids, stored=True)
        for k in lower.keys:
            if self.lower.store.lock(k.digest):
                plan.locked_keys.append(k.digest)
        plan.lower.append((start, end, lower))
        return ChunkLookup(lower.tier, lower.ranking)

    def _sighted(self, plan: RequestPlan, chunk_ids: tuple[int, ...], stored: bool) -> bool:
        """Tells store admission of one lookup; whether a miss is stored. Sightings count
        per namespace: one tenant's traffic never changes how another's misses are
        handled."""
        return self._batch_admission.lookup(hash((plan.pending.namespace, chunk_ids)), stored)

    # ----------------------------------------------------------------- phase 1
    def _phase1(self, stack: Stack, live: Any, plans: dict[int, RequestPlan]) -> None:
        """Computes the independent KV of missing chunks, stores it, re-rotates it in place."""
        misses = [(plan, s, e) for plan in plans.values() for s, e in plan.misses]
        if not misses:
            return
        rows = self.phases.scratch_rows(min(len(misses), MAX_SCRATCH_ROWS))
        if rows is None:
            rows = self.phases.scratch_rows(1)
        if rows is None:
            raise NoScratchRows("no free request rows for phase 1")
        table = self.phases.req_to_token
        try:
            for at in range(0, len(misses), len(rows)):
                batch = misses[at : at + len(rows)]
                subs, ids = [], []
                for row, (plan, start, end) in zip(rows, batch, strict=False):
                    table[row, : end - start] = self._slots(plan, start, end).to(table.dtype)
                    subs.append(SubRequest(row, 0, end - start))
                    ids.extend(plan.pending.token_ids[start:end])
                ids_t = torch.tensor(ids, dtype=torch.int64, device=table.device)
                self._run("phase1", stack, self.phases.prepare(live, subs, ids_t))
        finally:
            self.phases.free_rows(rows)
        for plan, start, end in misses:
            slots = self._slots(plan, start, end)
            chunk_ids = plan.pending.token_ids[start:end]
            # All of it on one thread, as the copies: small ops, where OpenMP's barriers
            # under a serving load cost more than a second thread gains (``single_thread``).
            with single_thread():
                kv = self.kv.read(slots)  # keys at positions 0..n-1
                # Pre-RoPE keys, once: CacheTune ranks them and the lower tiers store them.
                k_pre = self.kv.pre_rope_keys(kv)
                # The server's alpha: the chunk's keys name it (``ranking_recipe``).
                ranking = cachetune_ranking(
                    k_pre, kv[:, 1], self.config.cachetune_alpha, reduce=self.reduce
                ).cpu()  # read on the host once: the plan, the chunk node and the tiers use it
                ns = plan.pending.namespace  # stored in its own namespace only
                self._store(chunk_ids, kv, ranking, ns)
                if self.lower is not None:
                    # Write-through: the host tier then puts it on disk in the background.
                    self.lower.put_chunk(chunk_ids, k_pre, kv[:, 1], ranking, ns)
                self.kv.write_rotated(slots, kv, start)
            i = next(j for j, s in enumerate(plan.layout.chunks) if s.start == start)
            plan.rankings[i] = ranking
            assert plan.stats is not None
            plan.stats = plan.stats._replace(
                misses=plan.stats.misses + 1,
                encoded_tokens=plan.stats.encoded_tokens + end - start,
            )

    def _store(
        self,
        chunk_ids: tuple[int, ...],
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim], K at 0..n-1
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
    ) -> None:
        """New chunk nodes of ``namespace`` for the segments not held, when the pool share
        has room."""
        inserted = (
            self.nodes.insert(chunk_ids, ranking, namespace) if self.nodes.capacity_tokens else ()
        )
        if inserted is None:
            self.metrics.node_insert_failures.inc()
        elif inserted:
            try:
                for node, key in zip(*inserted, strict=True):
                    self.kv.write_rotated(node.kv_slots, kv[:, :, key.start : key.end], 0)
            except BaseException:
                # Linked but never written: a later device hit would copy whatever the
                # slots held before.
                self.nodes.discard(inserted[0])
                raise

    def _store_locked(
        self,
        chunk_ids: tuple[int, ...],
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim], K at 0..n-1
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
    ) -> None:
        with single_thread():
            self._store(chunk_ids, kv, ranking, namespace)

    # ----------------------------------------------------------------- phase 2
    def _phase2(
        self,
        stack: Stack,
        input_ids: torch.Tensor,  # [n] extend tokens of the live batch
        live: Any,
        plans: dict[int, RequestPlan],
    ) -> torch.Tensor:
        """One phase batch: every chunked request's runs and every plain request."""
        prefix_lens = list(live.extend_prefix_lens_cpu)
        ext_lens = list(live.extend_seq_lens_cpu)
        pool_idx = planner.pool_rows(live)
        runs: dict[int, list[Run]] = {}
        t0 = time.perf_counter()
        scores = self._query_attention(stack, live, plans)
        probe_s = time.perf_counter() - t0
        for b, plan in plans.items():
            sel = planner.select(
                plan,
                lambda plan=plan: self._deviation(stack, live, plan),
                self.ratios,
                lambda b=b, plan=plan: (
                    scores[b] if b in scores else self._probe_one(stack, live, b, plan)
                ),
            )
            if b in scores:
                # The shared probe pass ran before selection; each request waited for it.
                assert plan.stats is not None
                plan.stats = plan.stats._replace(
                    selection_seconds=plan.stats.selection_seconds + probe_s
                )
            runs[b] = runs_of(sel, self.merge_gap)
        self._fit(runs, plans, len(pool_idx) - len(plans))
        device = input_ids.device
        subs: list[SubRequest] = []
        rows: list[torch.Tensor] = []
        feeds: list[LayerFeed] = []
        row_in = 0
        for b, idx in enumerate(pool_idx):
            p, e = prefix_lens[b], ext_lens[b]
            plan = plans.get(b)
            if plan is None:
                subs.append(SubRequest(idx, p, e))
                rows.append(torch.arange(row_in, row_in + e, device=device))
            else:
                plan.runs = len(runs[b])
                for run in runs[b]:
                    subs.append(SubRequest(idx, run.start, run.end - run.start))
                    rows.append(
                        torch.arange(row_in + run.start - p, row_in + run.end - p, device=device)
                    )
                if plan.lower:
                    assert plan.selected is not None
                    feeds.append(self._feed(plan, plan.selected))
            row_in += e
        self.metrics.phase2_runs.inc(sum(plan.runs for plan in plans.values()))
        take = torch.cat(rows)
        phase = self.phases.prepare(live, subs, input_ids[take])
        for feed in feeds:
            feed.start()
        try:
            out = self._run(
                "phase2", stack, phase, before_layer=[feed.before_layer for feed in feeds]
            )
        finally:
            for feed in feeds:
                feed.close()
        for feed in feeds:
            if not feed.done:
                raise RuntimeError("phase 2 ended before every layer's reused KV was loaded")
            self._count_loaded(feed)
        hidden = out.new_zeros((input_ids.shape[0], out.shape[-1]))
        hidden[take] = out
        return hidden

    def _fit(self, runs: dict[int, list[Run]], plans: dict[int, RequestPlan], plain: int) -> None:
        """Merges runs across growing gaps until the phase batch fits the backend's plan
        buffers (``PhaseRunner.max_subrequests``); merged gaps are recomputed too."""
        cap = self.phases.max_subrequests
        gap = max(self.merge_gap, 1)
        while cap is not None and plain + sum(len(r) for r in runs.values()) > cap:
            for b, plan in plans.items():
                assert plan.selected is not None
                runs[b] = runs_of(plan.selected, gap)
            gap *= 2
            self.metrics.run_merges.inc()
        for b, plan in plans.items():
            covered = sum(run.end - run.start for run in runs[b])
            if plan.selected is not None and covered != plan.selected.numel():
                self._merged(plan, runs[b])

    @staticmethod
    def _merged(plan: RequestPlan, runs: list[Run]) -> torch.Tensor:
        """The positions of merged runs (# [k']), with the plan's stats brought in line."""
        sel = torch.cat([torch.arange(a, z) for a, z in runs])  # host: planning
        assert plan.stats is not None and plan.selected is not None
        extra = planner.count_in(sel, plan.hit_spans) - planner.count_in(
            plan.selected, plan.hit_spans
        )
        plan.stats = plan.stats._replace(
            recomputed_tokens=int(sel.numel()),
            reused_tokens=plan.stats.reused_tokens - extra,
        )
        plan.selected = sel
        return sel

    def _deviation(self, stack: Stack, live: Any, plan: RequestPlan) -> torch.Tensor:
        """CacheBlend's online signal # [prompt_len]: every token past the device prefix runs
        layer 0 and 1 against the assembled KV, and its layer-1 K/V are compared with the
        reused ones. Needs every reused token in the pool first, so lower-tier chunks are
        loaded whole here (CacheBlend compares against all of them)."""
        if plan.lower:
            # Loaded here, before any forward pulls it: in order, on this thread.
            none = torch.empty(0, dtype=torch.int64)  # host: planning, nothing recomputed
            feed = self._feed(plan, none, mode="inorder")
            for layer in range(self.kv.num_layers):
                feed.before_layer(layer)
            self._count_loaded(feed)
            plan.loaded_whole.extend(plan.lower)  # still promoted after the batch
            plan.lower.clear()
        toks = plan.pending.token_ids
        n, p = len(toks), plan.prefix
        probe = DeviationProbe(self.kv.pool, self._slots(plan, p), reduce=self.reduce)
        ids = torch.tensor(toks[p:], dtype=torch.int64, device=self.kv.device)
        phase = self.phases.prepare(live, [SubRequest(plan.pool_idx, p, n - p)], ids)
        with contextlib.suppress(ProbeDone):
            self._run("deviation", stack, phase, after_layer=[probe.after_layer])
        if probe.deviation is None:
            raise RuntimeError("the deviation pass ended without reaching layer 1")
        dev = torch.zeros(n)  # host: planning
        dev[p:] = probe.deviation.cpu()
        fresh = plan.layout.fresh_indices()
        dev[torch.tensor(fresh, dtype=torch.int64)] = 0.0  # host: planning
        return dev

    def _query_attention(
        self, stack: Stack, live: Any, plans: dict[int, RequestPlan]
    ) -> dict[int, torch.Tensor]:
        """The query-aware signal # [prompt_len] of each plan whose policy reads it and
        that has chunks past its device prefix (``QueryProbe``): the tokens phase 2
        computes whatever the policy says (fresh, forced, the last) run the first
        ``qa_layers`` layers over the assembled KV, every such plan of the batch in one
        pass per ``qa_layers`` value. Lower-tier chunks get those layers loaded whole first
        (in order, on this thread); phase 2 loads the rest sparsely."""
        wanted: dict[int, list[int]] = {}
        for b, plan in plans.items():
            if make_policy(plan.config).needs_query_attention and (plan.hit_spans or plan.misses):
                layers = min(plan.config.qa_layers, self.kv.num_layers)
                wanted.setdefault(layers, []).append(b)
        scores: dict[int, torch.Tensor] = {}
        for layers, group in wanted.items():
            scores.update(self._probe_pass(stack, live, {b: plans[b] for b in group}, layers))
        return scores

    def _probe_one(self, stack: Stack, live: Any, b: int, plan: RequestPlan) -> torch.Tensor:
        """The signal of a plan the batch's pass left out (a policy that reads it without
        declaring ``needs_query_attention``), from a pass of its own."""
        layers = min(plan.config.qa_layers, self.kv.num_layers)
        return self._probe_pass(stack, live, {b: plan}, layers)[b]

    def _probe_pass(
        self, stack: Stack, live: Any, plans: dict[int, RequestPlan], layers: int
    ) -> dict[int, torch.Tensor]:
        """One probe pass over ``layers`` layers for ``plans`` (``_query_attention``)."""
        for plan in plans.values():
            if plan.lower:
                none = torch.empty(0, dtype=torch.int64)  # host: planning, none recomputed
                feed = self._feed(plan, none, mode="inorder")
                try:
                    for layer in range(layers):
                        feed.before_layer(layer)
                finally:
                    feed.close()
                self._count_loaded(feed)
        must: dict[int, torch.Tensor] = {}
        for b, plan in plans.items():
            n, p = plan.num_tokens, plan.prefix
            assert plan.forced is not None
            fresh = torch.tensor(plan.layout.fresh_indices() + [n - 1])  # host: planning
            idx = torch.unique(torch.cat([plan.forced, fresh]).to(torch.int64))
            must[b] = idx[idx >= p]
        runs = {b: runs_of(idx) for b, idx in must.items()}
        cap = self.phases.max_subrequests
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
            probes[b] = QueryProbe(
                self.kv.pool, self._slots(plan), rows, queries, layers, self.reduce
            )
            toks = torch.tensor(plan.pending.token_ids, dtype=torch.int64)  # host: planning
            ids.append(toks[idx])
            subs += [SubRequest(plan.pool_idx, a, z - a) for a, z in runs[b]]
            row += idx.numel()
        phase = self.phases.prepare(live, subs, torch.cat(ids).to(self.kv.device))
        self.metrics.probe_passes.inc()
        hooks = [p.after_attention for p in probes.values()]
        hooks.append(ProbeCut(layers).after_attention)
        with contextlib.suppress(ProbeDone):
            self._run("probe", stack, phase, after_attention=hooks)
        return dict(zip(probes, host_scores(list(probes.values())), strict=True))

    def _run(self, kind: str, stack: Stack, phase: PhaseBatch, **callbacks: Any) -> torch.Tensor:
        """``phases.run`` (with the layer and attention ``callbacks`` it takes), counted by
        kind (``PicMetrics.phase_forwards``) before it runs, so that a pass its probe cuts
        short counts too."""
        self.metrics.phase_forwards.labels(phase=kind).inc()
        tokens = sum(sub.extend for sub in phase.subrequests)
        self.metrics.phase_forward_tokens.labels(phase=kind).inc(tokens)
        self.metrics.phase_attended_keys.labels(phase=kind).inc(attended_keys(phase.subrequests))
        return self.phases.run(stack, phase, **callbacks)

    def _count_loaded(self, feed: LayerFeed) -> None:
        self.metrics.bytes_loaded.inc(feed.bytes_moved)
        self.metrics.bytes_dense.inc(feed.bytes_dense)

    def _feed(self, plan: RequestPlan, sel: torch.Tensor, mode: str | None = None) -> LayerFeed:
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
            self._slots(plan),
            self.kv,
            self.kv.num_layers,
            mode or self.feed_mode,
            timeout_s=self.feed_timeout_s,
        )

    def _promote(self, plans: dict[int, RequestPlan]) -> None:
        """Lower-tier chunks the request used become chunk nodes (``Promoter``)."""
        for plan in plans.values():
            for start, end, hit in plan.lower + plan.loaded_whole:
                self.promoter.submit(
                    hit, plan.pending.token_ids[start:end], hit.ranking, hit.namespace
                )

    def _release(self, plans: dict[int, RequestPlan]) -> None:
        for plan in plans.values():
            self.nodes.unlock(plan.locked_nodes)
            plan.locked_nodes.clear()
            if self.lower is not None:
                for key in plan.locked_keys:
                    self.lower.store.unlock(key)
            plan.locked_keys.clear()


def _no_load(hit: Any, chunk_ids: tuple[int, ...]) -> None:
    return None
