"""Steps 1 and 2 of a chunked batch: where each chunk is reused from (``Lookup``), then the
device hits copied into the requests' slots at their positions (``Assemble``).

Each chunk past the device prefix is looked up in the request's readable namespaces only
(``gate.Pending.readable``, its own first), in the chunk nodes (device tier), then host
memory and disk. A device hit is copied into the request's own slots and re-rotated to the
chunk's position (the node stays as it was); a lower-tier hit is loaded during phase 2. A
chunk found nowhere is stored by phase 1 unless store admission defers it (computed in
context in phase 2, like fresh text). Everything a request reads stays locked until the
batch ends (``Release``)."""

from __future__ import annotations

import torch

from sgl_pic.engine import planner
from sgl_pic.engine.batch import BatchContext, HitCopy, Plans
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.planner import ChunkLookup, RequestPlan
from sgl_pic.engine.promoter import Promoter


class Lookup:
    """Reads: each plan's marks and device prefix; the chunk nodes, the lower tiers, the
    promoter's jobs (a chunk whose promotion is under way is finished first).
    Writes: each plan's rankings, hits, misses, deferred chunks, forced positions, stats
    and locks (``planner.classify``); ``ctx.copies`` (device hits); ``ctx.admission``
    (one sighting per chunk)."""

    def __init__(self, nodes: ChunkNodeTable, forwards: PhaseForwards, promoter: Promoter) -> None:
        self.nodes = nodes
        self.forwards = forwards
        self.promoter = promoter

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        for plan in plans.values():
            planner.classify(
                plan,
                lambda s, e, plan=plan: self.lookup(plan, s, e, ctx),
                lambda s, e, keep, plan=plan: self.lookup(plan, s, e, ctx, keep),
            )

    def lookup(
        self,
        plan: RequestPlan,
        start: int,
        end: int,
        ctx: BatchContext,
        keep: int | None = None,
    ) -> ChunkLookup:
        """Where chunk [start, end) is reused from. A device hit's copy into the request's
        slots is added to ``ctx.copies``; its nodes and a lower hit's records stay locked
        until the batch ends, so nothing the request reads is evicted under it. ``keep``:
        when the device prefix ends inside the chunk, its first position past the prefix;
        only the chunk's rows from ``keep`` on are written (the prefix's slots are shared
        and stay as they are): a device copy's, or a host/disk record's loaded whole here.
        A miss says whether store admission lets phase 1 encode and store it (whole, apart
        from the prefix's slots, when cut)."""
        keep = start if keep is None else keep
        chunk_ids = plan.pending.token_ids[start:end]
        lower_tiers = self.forwards.lower
        # Only the request's own namespace and the public ones it may read, own first
        # (``gate.Pending``): no lookup of any tier crosses into another tenant's chunks.
        readable = plan.pending.readable
        for ns in readable:
            if (ns, chunk_ids) in self.promoter:
                # Its full load is already under way: finishing it costs less than loading
                # the chunk again from the lower tier.
                self.promoter.finish((ns, chunk_ids), self.forwards.feed_timeout_s)
        hit = next(
            (h for ns in readable if (h := self.nodes.match(chunk_ids, ns)) is not None), None
        )
        if hit is not None:
            sighted(ctx, plan, chunk_ids, stored=True)
            self.nodes.lock(hit.nodes)
            plan.locked_nodes.extend(hit.nodes)
            # Rows keep - start.. hold keys at those chunk positions: moving them by
            # ``start`` puts them at keep..end-1.
            ctx.copies.append(
                HitCopy(hit.slots[keep - start :], self.forwards.slots(plan, keep, end), start)
            )
            return ChunkLookup("device", hit.ranking)
        lower = None
        if lower_tiers is not None:
            lower = next(
                (h for ns in readable if (h := lower_tiers.match(chunk_ids, ns)) is not None),
                None,
            )
        if lower is not None and keep > start:
            # Cut by the device prefix: loaded whole now and its rows from ``keep`` on
            # written (the layer feed places whole chunks, and the prefix's slots are
            # shared); a record gone bad makes it a miss.
            assert lower_tiers is not None
            kv = lower_tiers.load_full(lower, chunk_ids)
            if kv is not None:
                sighted(ctx, plan, chunk_ids, stored=True)
                tail = kv[:, :, keep - start :].contiguous()
                self.forwards.kv.write_rotated(self.forwards.slots(plan, keep, end), tail, start)
                return ChunkLookup(lower.tier, lower.ranking)
            lower = None
        if lower is None:
            return ChunkLookup(None, None, sighted(ctx, plan, chunk_ids, stored=False))
        assert lower_tiers is not None
        sighted(ctx, plan, chunk_ids, stored=True)
        for k in lower.keys:
            if lower_tiers.store.lock(k.digest):
                plan.locked_keys.append(k.digest)
        plan.lower.append((start, end, lower))
        return ChunkLookup(lower.tier, lower.ranking)


def sighted(ctx: BatchContext, plan: RequestPlan, chunk_ids: tuple[int, ...], stored: bool) -> bool:
    """Tells store admission of one lookup; whether a miss is stored. Sightings count per
    namespace: one tenant's traffic never changes how another's misses are handled."""
    return ctx.admission.lookup(hash((plan.pending.namespace, chunk_ids)), stored)


class Assemble:
    """Reads: ``ctx.copies``. Writes: the requests' slots of every device hit (the node's
    KV, keys re-rotated to the chunk's position), all of the batch's in one call."""

    def __init__(self, forwards: PhaseForwards) -> None:
        self.kv = forwards.kv

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        copies = ctx.copies
        if not copies:
            return
        device = self.kv.device
        self.kv.copy_rotated(
            torch.cat([c.src.to(device) for c in copies]),
            torch.cat([c.dst.to(device) for c in copies]),
            torch.cat([torch.full((c.src.numel(),), c.delta, device=device) for c in copies]),
        )


class Release:
    """Reads and empties: each plan's locked chunk nodes and lower-tier records (run after
    every attempt, whatever ended it)."""

    def __init__(self, nodes: ChunkNodeTable, forwards: PhaseForwards) -> None:
        self.nodes = nodes
        self.lower = forwards.lower

    def run(self, plans: Plans, ctx: BatchContext | None = None) -> None:
        for plan in plans.values():
            self.nodes.unlock(plan.locked_nodes)
            plan.locked_nodes.clear()
            if self.lower is not None:
                for key in plan.locked_keys:
                    self.lower.store.unlock(key)
            plan.locked_keys.clear()
