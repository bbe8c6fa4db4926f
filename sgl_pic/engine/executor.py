"""Two-phase chunk execution of one extend batch, as SGLang-native phase batches.

The runner's decoder stack hands the executor every extend batch (``model_hooks``, through
``PicRuntime.on_extend``). When requests in it carry verified chunk marks, the batch
becomes phase forwards over the same KV pool, each an ordinary extend batch planned by the
selected attention backend (``phase_port.PhaseRunner``, which ``binding.phases``
implements), in this order of steps, each a module of its own with a ``run(plans, ctx)``
contract (``batch.Step``):

lookup:   each chunk past the device prefix is found in the chunk nodes, host memory or
          disk, or is a miss that store admission stores or defers (``lookup.Lookup``);
assemble: device hits are copied into the requests' slots at their positions
          (``lookup.Assemble``);
phase 1:  stored misses run from position 0 over their own slots; their independent KV
          becomes chunk nodes and host-tier records (``phase1.Phase1``);
signals:  the query-aware probe over the assembled KV, for the plans that read it
          (``signals.Signals``; CacheBlend's deviation runs on demand during selection);
select:   each policy's positions, as runs that fit the backend (``select.Select``);
phase 2:  every chunked request's runs and every plain request in one forward, lower-tier
          chunks loaded layer by layer during it (``phase2.Phase2``);
promote:  lower-tier chunks the batch used become chunk nodes (``promoter.Promote``).

A stored chunk that goes bad mid-load makes the batch run its steps once more; whatever
ends an attempt, the chunks it locked are released (``lookup.Release``). Requests asking
for input-token logprobs run as plain requests (``batch.chunk_specs``), and requests for
every row's hidden state never reach here: the gate runs them exact.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.engine.batch import BatchContext, ChunkSpec, Plans, Stack, chunk_specs
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.forwards import HiddenSpec, PhaseForwards
from sgl_pic.engine.kv_access import KVAccess, single_thread
from sgl_pic.engine.kv_reads import ReadCap
from sgl_pic.engine.layer_feed import FeedTimeout, MissingChunkError
from sgl_pic.engine.lookup import Assemble, Lookup, Release
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.phase1 import NodeWriter, NoScratchRows, Phase1
from sgl_pic.engine.phase2 import Phase2
from sgl_pic.engine.phase_port import PhaseRunner
from sgl_pic.engine.piece_steps import FirstPieces, SplitRequests
from sgl_pic.engine.pieces import PiecePlans
from sgl_pic.engine.promoter import Promote, Promoter
from sgl_pic.engine.rank_agreement import RankAgreement
from sgl_pic.engine.select import Select
from sgl_pic.engine.signals import Signals
from sgl_pic.store.admission import BatchAdmission, StoreAdmission

logger = logging.getLogger(__name__)

__all__ = ["ChunkExecutor", "NoScratchRows"]


class ChunkExecutor:
    """nodes:  the radix cache's chunk nodes (device tier).
    phases:    runs phase batches through SGLang's backend and the decoder stack.
    lower:     host and disk tiers, or None when both are off.
    ratios:    calibrated CacheTune r per tier ("device", "host", "disk"), or None.
    feed_mode: how lower-tier KV is loaded during phase 2 ("threaded" or "inorder").
    feed_timeout_s: longest wait for one layer of lower-tier KV (``FeedTimeout`` past it).
    merge_gap: phase-2 runs separated by at most this many tokens are merged.
    read_cap:  the bound on each request's phase-2 KV reads (``select.bound_runs``).
    admission: whether a chunk found nowhere is stored (phase 1) or computed in context;
               None stores every one.
    reduce:    sums a device tensor over the tensor-parallel ranks, so that signals computed
               from each rank's own heads (CacheBlend's deviation, the query probe) select
               the same tokens everywhere; None on one rank.
    sync_deletions: applies the deletion orders other servers sharing the store issued
               to the chunk nodes (``Deleter.sync``); called before each batch's lookups,
               so a chunk deleted anywhere is not found here afterwards. None: nothing to
               sync.
    hidden:    the decoder stack's output rows (a batch of prefill pieces with nothing to
               recompute runs no forward).
    ranks:     decides what every tensor-parallel rank must do alike (lookups, admission,
               a record that failed while loading, a split request's scratch row); None on
               one rank.
    make_room: frees at least n pool slots where it can (SGLang's prefix tree first, then
               chunk nodes: the radix cache's eviction), for slots the executor takes of
               its own; None: chunk nodes only.
    Worker side: ``forward`` runs on the scheduler's forward thread; ``served_rows`` then
    holds the live batch's indices of the requests it served over reused KV (runs of phase
    2), until the next ``forward``."""

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
        read_cap: ReadCap | None = None,
        admission: StoreAdmission | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        sync_deletions: Callable[[], object] | None = None,
        hidden: HiddenSpec | None = None,
        ranks: RankAgreement | None = None,
        make_room: Callable[[int], int] | None = None,
    ) -> None:
        self.config = settings_config
        self.served_rows: tuple[int, ...] = ()
        self.sync_deletions = sync_deletions
        self.nodes = nodes
        self.lower = lower
        self.kv = kv
        self.metrics = metrics
        self.phases = phases
        self.admission = admission
        self.ranks = ranks if ranks is not None else RankAgreement()
        room = make_room if make_room is not None else nodes.evict
        forwards = PhaseForwards(
            kv, phases, metrics, lower, feed_mode, feed_timeout_s, reduce, hidden, self.ranks
        )
        self.writer = NodeWriter(nodes, kv, metrics.node_insert_failures.inc)
        self.promoter = Promoter(
            nodes,
            (lambda hit, ids: lower.load_full(hit, ids)) if lower is not None else _no_load,
            self.writer.write_locked,
            metrics,
        )
        signals = Signals(forwards)
        self.lookup = Lookup(nodes, forwards, self.promoter, self.ranks)
        self.assemble = Assemble(forwards)
        self.phase1 = Phase1(settings_config, forwards, self.writer, room, self.ranks)
        self.signals = signals
        self.select = Select(forwards, signals, ratios, merge_gap, read_cap)
        self.phase2 = Phase2(forwards)
        self.promote = Promote(self.promoter)
        self.release = Release(nodes, forwards)
        self.first_pieces = FirstPieces(forwards)
        plans = PiecePlans(
            phases.req_to_token,
            phases.scratch_rows,
            phases.free_rows,
            nodes.allocator,
            room,
            kv,
        )
        self.split = SplitRequests(plans, self.ranks, metrics)

    def held_tokens(self) -> int:
        """Scheduler side: pool slots held for split requests' carried plans (reported to
        SGLang's memory accounting as protected)."""
        return self.split.plans.held_tokens

    def forget_split_plans(self) -> None:
        """Scheduler side, after a flush reset SGLang's allocator and request table: every
        carried plan is forgotten, nothing given back (``PiecePlans.forget_all``)."""
        self.split.plans.forget_all()

    def rekey(self, model_id: str) -> None:
        """Scheduler side, after SGLang changed the served weights: every chunk is keyed
        under ``model_id`` from now on in every table (``ChunkNodeTable.rekey``,
        ``LowerTiers.rekey``), so nothing stored under the old weights is found again."""
        self.nodes.rekey(dataclasses.replace(self.nodes.fingerprint, model_id=model_id))
        if self.lower is not None:
            self.lower.rekey(dataclasses.replace(self.lower.fingerprint, model_id=model_id))

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
        self.served_rows = ()
        if len(self.promoter):
            self.promoter.finish_ready()
        split = self.split
        specs, pieces = chunk_specs(live, handoff, self.config, self.metrics, split.plans)
        if not specs and not pieces:
            return None
        if self.sync_deletions is not None:
            self.sync_deletions()
        specs = split.reserve(specs)
        if not specs and not pieces:
            return None  # every first piece went without a reservation: none is held
        admission = BatchAdmission(self.admission)
        try:
            ctx = BatchContext(stack, input_ids, live, admission)
            split.later_pieces(pieces, ctx)
            hidden = self._attempts(specs, ctx)
            self.export_sizes()
            # The batch's last collective: a rank that failed after the others' last one
            # meets them here, and all fall back together.
            self.ranks.proceed()
        except BaseException:
            admission.abandon()  # the runtime reruns it as plain prefill
            split.abandon(specs, pieces)
            raise
        split.commit(specs, pieces, ctx)
        self.served_rows = tuple(sorted(ctx.runs))
        return hidden

    def _attempts(self, specs: dict[int, ChunkSpec], ctx: BatchContext) -> torch.Tensor:
        """Runs the batch's steps, a second time if a stored chunk goes bad mid-load on any
        tensor-parallel rank (all ranks alike); # [n, hidden]. Later pieces of requests
        planned earlier (``ctx.runs`` and ``ctx.rows`` set for them) take part in phase 2
        only."""
        carried = dict(ctx.runs)
        loader = self.lower.loader if self.lower is not None else None
        for attempt in range(2):
            plans: Plans = {b: spec.plan() for b, spec in specs.items()}
            ctx.copies = []
            ctx.feed_timed_out = ctx.feed_failed = False
            ctx.runs = dict(carried)
            t0 = time.perf_counter()
            missed = loader.stats().misses if loader is not None else 0
            try:
                times = _run_steps(self, plans, ctx, t0, missed)
                break
            except MissingChunkError:
                # A host/disk record failed its checks mid-load on some rank; its store has
                # counted and dropped it. Every slot the attempt wrote is written again by
                # the next one, where that chunk misses on every rank (``Lookup``) and,
                # admitted as the stored chunk it was in this attempt, is recomputed and
                # stored afresh.
                if attempt:
                    raise
                logger.warning("sgl_pic: a stored chunk went bad while loading; retrying")
                self.metrics.retries.inc()
                ctx.admission.retry()
            except FeedTimeout:
                self.metrics.feed_timeouts.inc()
                raise  # the runtime reruns the batch as exact prefill
            finally:
                self.release.run(plans, ctx)
                if self.lower is not None:
                    self.metrics.record_store_errors(self.lower.store.stats().errors)
                    self.lower.export_stats(self.metrics)
        report(plans, times.first_s, times.second_s, self.metrics)
        assert ctx.hidden is not None
        return ctx.hidden

    def export_sizes(self) -> None:
        """Chunk-node slots, store admission's reuse rate, evictions per tier and (where
        the operator enabled them) per-namespace sizes into the metrics, after a batch."""
        self.metrics.node_tokens.set(self.nodes.allocated_tokens)
        if self.admission is not None:
            self.metrics.admission_reuse_rate.set(self.admission.reuse_rate)
        evictions = {"device": self.nodes.eviction.evicted}
        if self.lower is not None:
            evictions["host"] = self.lower.store.host.stats().evictions
            evictions["disk"] = self.lower.store.disk.stats().evictions
        self.metrics.record_evictions(evictions)
        self.export_namespace_sizes()

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

    def request_done(self, rid: str) -> None:
        """Scheduler side: SGLang ended request ``rid``; a plan carried for its next
        prefill pieces is dropped, its scratch row and slots given back."""
        self.split.plans.drop(rid)

    def close(self) -> None:
        """Joins the promoter's worker (shutdown)."""
        self.promoter.close()


class _StepTimes(NamedTuple):
    """Seconds of one attempt's steps, as ``report`` logs them."""

    first_s: float  # lookups, assembly and phase 1
    second_s: float  # signals, selection, first pieces and phase 2


def _run_steps(
    executor: ChunkExecutor, plans: Plans, ctx: BatchContext, t0: float, missed: int
) -> _StepTimes:
    """One attempt of ``ChunkExecutor._attempts``: every step in order, the ranks'
    agreement on the feeds (``_agree_feeds``), then promotion. ``t0``: when the attempt
    began; ``missed``: the lower-tier loader's misses then (0 without one). Raises
    ``MissingChunkError`` where a record failed while loading on any rank."""
    with single_thread():
        executor.lookup.run(plans, ctx)
        executor.assemble.run(plans, ctx)
    executor.phase1.run(plans, ctx)
    t1 = time.perf_counter()
    executor.signals.run(plans, ctx)
    executor.select.run(plans, ctx)
    executor.first_pieces.run(plans, ctx)
    executor.phase2.run(plans, ctx)
    t2 = time.perf_counter()
    loader = executor.lower.loader if executor.lower is not None else None
    _agree_feeds(executor.ranks, ctx, loader is not None and loader.stats().misses > missed)
    with single_thread():
        executor.promote.run(plans, ctx)
    return _StepTimes(t1 - t0, t2 - t1)


def _agree_feeds(ranks: RankAgreement, ctx: BatchContext, bad: bool) -> None:
    """Raises when any rank's feeds failed: ``FeedTimeout`` for a layer not loaded in time,
    RuntimeError for a failed feed, ``MissingChunkError`` for a record that failed while
    loading (``bad``). Feeds list these and go on (``layer_feed``): the ranks agree on
    them here, after every forward of the attempt, in one collective."""
    in_time, loaded, sound = ranks.all_of([not ctx.feed_timed_out, not ctx.feed_failed, not bad])
    if not in_time:
        raise FeedTimeout("a layer's reused KV was not loaded in time")
    if not loaded:
        raise RuntimeError("a layer feed failed during phase 2")
    if not sound:
        raise MissingChunkError("a lower-tier record failed while loading")


def report(plans: Plans, first_s: float, second_s: float, metrics: PicMetrics) -> None:
    """A served batch's log line (seconds of lookups, assembly and phase 1; of signals,
    selection and phase 2) and each plan's stats into the metrics."""
    logger.info(
        "sgl_pic batch: %d chunked request(s), assemble+phase 1 %.3f s, "
        "select+phase 2 %.3f s, recomputed %s in %s run(s)",
        len(plans),
        first_s,
        second_s,
        [p.stats.recomputed_tokens for p in plans.values() if p.stats is not None],
        [p.runs for p in plans.values()],
    )
    for plan in plans.values():
        assert plan.stats is not None
        metrics.record(plan.stats)
        metrics.record_namespace(plan.pending.namespace, plan.stats)


def _no_load(hit: Any, chunk_ids: tuple[int, ...]) -> None:
    return None
