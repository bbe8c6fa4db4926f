"""Step 3 of a chunked batch: phase 1, the stored KV of the chunks found nowhere.

Each admitted miss runs as a sub-request over its own slots (a scratch row of SGLang's
request table that holds them), from position 0, so its KV is the chunk's independent
KV, or, under ``chunk_context="first_chunk"``, right after its encoding context (the
prompt's tokens through its first chunk, ``gate.Pending.context_of``). The context's KV
is the request's own where its device prefix holds it and the first chunk starts the
prompt (then those slots hold what exact prefill computes); otherwise the context is
computed with the chunk on slots taken for it. The chunk's KV, keys moved to 0..n-1, is
copied into new chunk nodes (``NodeWriter``) and written through to the host tier under
a key naming the context, and its keys are re-rotated in place to the chunk's position;
ranked and copied a bounded piece at a time, however long the chunk (``chunk_store``).
A chunk the device prefix cuts is encoded on slots taken for it, and only its rows past
the prefix are written into the request's."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.runs import SubRequest
from sgl_pic.engine.batch import BatchContext, Plans
from sgl_pic.engine.chunk_nodes import ChunkNode, ChunkNodeTable, Keys, take_slots
from sgl_pic.engine.chunk_store import Destination, RecordSink, rank_miss, store_miss
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.kv_access import KVAccess, single_thread
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.engine.rank_agreement import RankAgreement
from sgl_pic.keys import SegmentKey

# Scratch rows phase 1 takes from SGLang's request table at once; more misses run in
# further rounds.
MAX_SCRATCH_ROWS = 16

Miss = tuple[RequestPlan, int, int]  # a plan and its chunk [start, end)


class Encoding(NamedTuple):
    """Where one miss is encoded: its chunk's slots, and its context's (# [context_end],
    empty for a chunk encoded alone); ``computed``: whether the context is computed with
    the chunk (its slots taken for it) rather than read from the request's prefix."""

    slots: torch.Tensor  # [end - start]
    context: torch.Tensor  # [context_end] or [0]
    computed: bool


class NoScratchRows(RuntimeError):
    """SGLang's request table has no free row for phase 1 (the batch runs exact)."""


class NodeWriter:
    """Writes chunks into new chunk nodes (phase 1's misses, the promoter's loads).
    ``on_insert_failure()`` counts a chunk the table had no room for."""

    def __init__(
        self, nodes: ChunkNodeTable, kv: KVAccess, on_insert_failure: Callable[[], None]
    ) -> None:
        self.nodes = nodes
        self.kv = kv
        self.on_insert_failure = on_insert_failure

    def insert(
        self,
        chunk_ids: tuple[int, ...],
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
        context: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> tuple[tuple[ChunkNode, ...], Keys]:
        """New chunk nodes of ``namespace`` (encoded after ``context``, whose first chunk's
        contents are ``context_contents``) for the segments not held, and their keys, when
        the pool share has room (none otherwise, counted). The caller fills them before
        anything reads them, or ``nodes.discard``s them: linked but never written, a later
        device hit would copy whatever the slots held before."""
        inserted = (
            self.nodes.insert(chunk_ids, ranking, namespace, context, context_contents)
            if self.nodes.capacity_tokens
            else ((), ())
        )
        if inserted is None:
            self.on_insert_failure()
            return (), ()
        return inserted

    def write(
        self,
        chunk_ids: tuple[int, ...],
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim], K at 0..n-1
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
        context: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> None:
        """``insert``, then each new node's KV from ``kv``, one segment at a time."""
        nodes, keys = self.insert(chunk_ids, ranking, namespace, context, context_contents)
        try:
            for node, key in zip(nodes, keys, strict=True):
                self.kv.write_rotated(node.kv_slots, kv[:, :, key.start : key.end], 0)
        except BaseException:
            self.nodes.discard(nodes)
            raise

    def write_locked(
        self,
        chunk_ids: tuple[int, ...],
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim], K at 0..n-1
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
        context: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> None:
        """``write`` on one thread (``single_thread``), as the promoter calls it."""
        with single_thread():
            self.write(chunk_ids, kv, ranking, namespace, context, context_contents)


class Phase1:
    """Reads: each plan's misses (``Lookup``). Writes: their slots (independent KV, then
    re-rotated to the chunk's position), new chunk nodes and host-tier records of them,
    each plan's rankings of its misses and its stats (misses, encoded tokens)."""

    def __init__(
        self,
        config: PicConfig,
        forwards: PhaseForwards,
        writer: NodeWriter,
        make_room: Callable[[int], int] | None = None,
        ranks: RankAgreement | None = None,
    ) -> None:
        self.config = config
        self.forwards = forwards
        self.writer = writer
        self.ranks = ranks if ranks is not None else RankAgreement()
        # Frees pool slots for a cut chunk's own (the radix cache's eviction).
        self.make_room = make_room if make_room is not None else writer.nodes.evict

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        misses = [(plan, s, e) for plan in plans.values() for s, e in plan.misses]
        if not misses:
            return
        # Where each miss is encoded: its own slots, or slots of its own for a chunk the
        # device prefix cuts (the prefix's slots are shared and hold the prefix's KV); and
        # where its context is (``Encoding``).
        where: list[Encoding] = []
        temp: list[torch.Tensor] = []
        try:
            short = takes = False
            for plan, start, end in misses:
                own, context = end - start, plan.pending.context_for(start).end
                computed = plan.pending.context_computed(start, plan.prefix)
                taken = own * (start < plan.prefix) + context * computed
                takes |= taken > 0
                slots = None
                if taken:
                    slots = take_slots(self.writer.nodes.allocator, taken, self.make_room)
                    short |= slots is None
                    if slots is None:
                        continue
                    temp.append(slots)
                if start < plan.prefix:
                    assert slots is not None
                    chunk = slots[:own]
                else:
                    chunk = self.forwards.slots(plan, start, end)
                if computed:
                    assert slots is not None
                    held = slots[taken - context : taken]
                else:
                    held = self.forwards.slots(plan, 0, context)
                where.append(Encoding(chunk, held, computed))
            # The misses are the same on every tensor-parallel rank (``Lookup``), so is
            # whether this collective runs; a rank short of slots sends all of them to
            # exact prefill.
            if takes and not self.ranks.all_of([not short])[0]:
                raise NoScratchRows("no free slots to encode a chunk or its context")
            self._encode(misses, where, ctx)
            for (plan, start, end), enc in zip(misses, where, strict=True):
                ranking = self._store(plan, start, end, enc)
                i = next(j for j, s in enumerate(plan.layout.chunks) if s.start == start)
                plan.rankings[i] = ranking
                assert plan.stats is not None
                # A context computed with the chunk is encoded too.
                encoded = end - start + enc.context.numel() * enc.computed
                plan.stats = plan.stats._replace(
                    misses=plan.stats.misses + 1,
                    encoded_tokens=plan.stats.encoded_tokens + encoded,
                )
        finally:
            for slots in temp:
                self.writer.nodes.allocator.free(slots)

    def _encode(self, misses: list[Miss], where: list[Encoding], ctx: BatchContext) -> None:
        """The phase-1 forwards: every miss on a scratch row of its own over its slots,
        from position 0 or after its context (see ``Encoding``)."""
        phases = self.forwards.phases
        rows = phases.scratch_rows(min(len(misses), MAX_SCRATCH_ROWS))
        if rows is None:
            rows = phases.scratch_rows(1)
        if rows is None:
            raise NoScratchRows("no free request rows for phase 1")
        table = phases.req_to_token
        try:
            for at in range(0, len(misses), len(rows)):
                batch = misses[at : at + len(rows)]
                subs, ids = [], []
                for row, (plan, start, end), enc in zip(
                    rows, batch, where[at : at + len(rows)], strict=False
                ):
                    c, n = enc.context.numel(), end - start
                    table[row, :c] = enc.context.to(table.device, table.dtype)
                    table[row, c : c + n] = enc.slots.to(table.device, table.dtype)
                    if enc.computed:
                        subs.append(SubRequest(row, 0, c + n))
                        ids.extend(plan.pending.token_ids[:c])
                    else:
                        subs.append(SubRequest(row, c, n))
                    ids.extend(plan.pending.token_ids[start:end])
                ids_t = torch.tensor(ids, dtype=torch.int64, device=table.device)
                self.forwards.run("phase1", ctx.stack, phases.prepare(ctx.live, subs, ids_t))
        finally:
            phases.free_rows(rows)

    def _store(
        self,
        plan: RequestPlan,
        start: int,
        end: int,
        enc: Encoding,
    ) -> torch.Tensor:
        """Stores one encoded miss in the chunk nodes and the lower tiers and writes it to
        the request's slots past its device prefix, keys re-rotated to the chunk's
        position; its ranking # [end - start]. Piece by piece (``chunk_store``): what it
        stages on the device is bounded whatever the chunk's length."""
        kv_access, lower = self.forwards.kv, self.forwards.lower
        chunk_ids = plan.pending.token_ids[start:end]
        _, context, contents = plan.pending.context_for(start)
        ns = plan.pending.namespace  # stored in its own namespace only
        keep = max(start, plan.prefix)
        # All of it on one thread, as the copies: small ops, where OpenMP's barriers under
        # a serving load cost more than a second thread gains (``single_thread``).
        with single_thread():
            # Encoded after its context, its keys sit past it: stored at 0..n-1 as any.
            at = enc.context.numel()
            rows = kv_access.checked(enc.slots)
            # The server's alpha: the chunk's keys name it (``ranking_recipe``). Its
            # scores are summed over the ranks: a rank that failed meets them first.
            self.ranks.proceed()
            ranking = rank_miss(
                kv_access, rows, at, self.config.cachetune_alpha, self.forwards.reduce
            ).cpu()  # read on the host once: the plan, the chunk node and the tiers use it
            records = None
            if lower is not None:
                # Write-through: the host tier then puts it on disk in the background.
                keys = lower.keys(chunk_ids, ns, context)
                new = frozenset(k.digest for k in keys if not lower.store.contains(k.digest))

                def put(key: SegmentKey, k_pre: torch.Tensor, v: torch.Tensor) -> bool:
                    rank = ranking[key.start : key.end]
                    return lower.put_segment(key, chunk_ids, k_pre, v, rank, ns, contents)

                records = RecordSink(keys, new, put)
            nodes, node_keys = self.writer.insert(chunk_ids, ranking, ns, context, contents)
            try:
                targets = [
                    Destination(kv_access.checked(node.kv_slots), key.start)
                    for node, key in zip(nodes, node_keys, strict=True)
                ]
                if keep == start:
                    request = Destination(rows, 0)  # its own slots: rotated where it lies
                else:
                    past = kv_access.checked(self.forwards.slots(plan, keep, end))
                    request = Destination(past, keep - start)
                store_miss(kv_access, rows, at, targets, request, start, records)
            except BaseException:
                self.writer.nodes.discard(nodes)
                raise
        return ranking
