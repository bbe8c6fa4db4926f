"""Steps 1 and 2 of a chunked batch: where each chunk is reused from (``Lookup``), then the
device hits copied into the requests' slots at their positions (``Assemble``).

Each chunk past the device prefix is looked up in the request's readable namespaces only
(``gate.Pending.readable``, its own first), in the chunk nodes (device tier), then host
memory and disk. A device hit is copied into the request's own slots and re-rotated to the
chunk's position (the node stays as it was); a lower-tier hit is loaded during phase 2. A
chunk found nowhere is stored by phase 1 unless store admission defers it (computed in
context in phase 2, like fresh text). Everything a request reads stays locked until the
batch ends (``Release``). With tensor parallelism every rank looks in tiers of its own,
then the ranks agree on each chunk before any of it is acted on (``Lookup``,
``rank_agreement``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_pic.engine import planner
from sgl_pic.engine.batch import BatchContext, HitCopy, Plans
from sgl_pic.engine.chunk_nodes import ChunkHit, ChunkNodeTable
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.lower_tiers import LowerHit
from sgl_pic.engine.planner import ChunkLookup, RequestPlan
from sgl_pic.engine.promoter import Promoter
from sgl_pic.engine.rank_agreement import ChunkVote, RankAgreement


class Found(NamedTuple):
    """This rank's own find of chunk [start, end) of a plan, locked until the batch ends
    or the ranks agree it misses: its device copy, its lower-tier hit, or neither.
    ``keep``: the first position past the device prefix (``start`` unless the prefix ends
    inside the chunk: only its rows from ``keep`` on are then written, the prefix's slots
    being shared; the layer feed skips the rows before the prefix); ``keys``: the
    lower-tier records this find locked."""

    start: int
    end: int
    keep: int
    device: ChunkHit | None = None
    lower: LowerHit | None = None
    keys: tuple[str, ...] = ()

    def vote(self) -> ChunkVote:
        """What this rank puts to the others (``RankAgreement.agree_chunks``)."""
        if self.device is not None:
            return ChunkVote("device", self.device.ranking is not None)
        if self.lower is not None:
            return ChunkVote(self.lower.tier, self.lower.ranking is not None)
        return ChunkVote(None, True)


class Lookup:
    """Reads: each plan's marks and device prefix; the chunk nodes, the lower tiers, the
    promoter's jobs (a chunk whose promotion is under way is finished first).
    Writes: each plan's rankings, hits, misses, deferred chunks, forced positions, stats
    and locks (``planner.classify``); ``ctx.copies`` (device hits); ``ctx.admission``
    (one sighting per chunk).

    Every tensor-parallel rank finds each chunk in tiers of its own, so what a plan makes
    of a chunk is agreed first (``ranks``, a ``RankAgreement``): a miss on any rank is a
    miss on all (a rank that found it lets go of its find), a hit is planned and counted
    as the slowest tier any rank holds it in (each rank still reads its own copy: a
    device copy where it has one), and a miss is stored only where every rank's store
    admission would store it. The plans, and through them every forward of the batch,
    are then the same on every rank, whichever rank applied which deletions of the shared
    log (``Deleter.sync``) or lost which records."""

    def __init__(
        self,
        nodes: ChunkNodeTable,
        forwards: PhaseForwards,
        promoter: Promoter,
        ranks: RankAgreement | None = None,
    ) -> None:
        self.nodes = nodes
        self.forwards = forwards
        self.promoter = promoter
        self.ranks = ranks if ranks is not None else RankAgreement()

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        found = {b: [self.find(plan, *c) for c in looked_up(plan)] for b, plan in plans.items()}
        flat = [(plans[b], f) for b, fs in found.items() for f in fs]
        agreed = self.ranks.agree_chunks([f.vote() for _, f in flat])
        # Store admission hears of every lookup in prompt order, as the agreed outcome (a
        # chunk the device prefix ends inside included: a miss of it is encoded whole).
        admits: list[bool | None] = [
            sighted(ctx, plan, f.start, f.end, a.tier is not None)
            for (plan, f), a in zip(flat, agreed, strict=True)
        ]
        misses = [i for i, a in enumerate(admits) if agreed[i].tier is None and a is not None]
        agreed_admits = self.ranks.all_of([bool(admits[i]) for i in misses])
        for i, admit in zip(misses, agreed_admits, strict=True):
            admits[i] = admit
        outcomes = iter(
            [
                ((f.start, f.end), self.use(plan, f, a, ctx, admit is not False))
                for (plan, f), a, admit in zip(flat, agreed, admits, strict=True)
            ]
        )

        def outcome(start: int, end: int, keep: int | None = None) -> ChunkLookup:
            span, out = next(outcomes)
            assert span == (start, end), "classify asks in the order looked_up lists"
            return out

        for plan in plans.values():
            planner.classify(plan, outcome, outcome)

    def find(self, plan: RequestPlan, start: int, end: int, keep: int) -> Found:
        """Where this rank holds chunk [start, end) (see ``Found``), its device nodes or
        lower-tier records locked and listed in the plan's locks, so that nothing is
        evicted under the request; the batch's ``Release`` lets go of them."""
        chunk_ids = plan.pending.token_ids[start:end]
        lower_tiers = self.forwards.lower
        # Only the request's own namespace and the public ones it may read, own first
        # (``gate.Pending``): no lookup of any tier crosses into another tenant's chunks.
        readable = plan.pending.readable
        # Only KV encoded after what this chunk follows (``Pending.context_of``).
        context = plan.pending.context_of(start)
        for ns in readable:
            if (ns, context, chunk_ids) in self.promoter:
                # Its full load is already under way: finishing it costs less than loading
                # the chunk again from the lower tier.
                self.promoter.finish((ns, context, chunk_ids), self.forwards.feed_timeout_s)
        hit = next(
            (h for ns in readable if (h := self.nodes.match(chunk_ids, ns, context)) is not None),
            None,
        )
        if hit is not None:
            self.nodes.lock(hit.nodes)
            plan.locked_nodes.extend(hit.nodes)
            return Found(start, end, keep, device=hit)
        if lower_tiers is None:
            return Found(start, end, keep)
        lower = next(
            (h for ns in readable if (h := lower_tiers.match(chunk_ids, ns, context)) is not None),
            None,
        )
        if lower is None:
            return Found(start, end, keep)
        keys = tuple(k.digest for k in lower.keys if lower_tiers.store.lock(k.digest))
        plan.locked_keys.extend(keys)
        return Found(start, end, keep, lower=lower, keys=keys)

    def use(
        self, plan: RequestPlan, found: Found, agreed: ChunkVote, ctx: BatchContext, admit: bool
    ) -> ChunkLookup:
        """What the plan makes of ``found`` once the ranks agreed on it: a device hit's copy
        into the request's slots goes to ``ctx.copies``, a lower hit to the plan's loads
        (phase 2), each labelled with the agreed tier; a find the ranks agreed misses is
        let go of. ``admit``: on a miss, whether phase 1 stores it."""
        ranking = None
        if found.device is not None:
            ranking = found.device.ranking
        elif found.lower is not None:
            ranking = found.lower.ranking
        if agreed.tier is None:
            self.let_go(plan, found)
            return ChunkLookup(None, None, admit)
        start, keep, end = found.start, found.keep, found.end
        if found.device is not None:
            # Rows keep - start.. hold keys at those chunk positions: moving them by
            # ``start`` puts them at keep..end-1.
            slots = found.device.slots[keep - start :]
            ctx.copies.append(HitCopy(slots, self.forwards.slots(plan, keep, end), start))
        else:
            assert found.lower is not None
            plan.lower.append((start, end, found.lower))
        return ChunkLookup(agreed.tier, ranking if agreed.ranked else None)

    def let_go(self, plan: RequestPlan, found: Found) -> None:
        """Unlocks what ``find`` locked for ``found`` and takes it off the plan's locks."""
        if found.device is not None:
            self.nodes.unlock(found.device.nodes)
            for node in found.device.nodes:
                plan.locked_nodes.remove(node)
        if found.keys:
            assert self.forwards.lower is not None
            for key in found.keys:
                self.forwards.lower.store.unlock(key)
                plan.locked_keys.remove(key)


def looked_up(plan: RequestPlan) -> list[tuple[int, int, int]]:
    """(start, end, keep) of each chunk ``planner.classify`` asks about, in its order: every
    chunk past the device prefix, ``keep`` its first position past it."""
    return [
        (s.start, s.end, max(s.start, plan.prefix))
        for s in plan.pending.request.layout.chunks
        if s.end > plan.prefix
    ]


def sighted(ctx: BatchContext, plan: RequestPlan, start: int, end: int, stored: bool) -> bool:
    """Tells store admission of one lookup of chunk [start, end); whether a miss is stored.
    Sightings count per namespace and encoding context: one tenant's traffic never changes
    how another's misses are handled."""
    pending = plan.pending
    key = (pending.namespace, pending.context_of(start), pending.token_ids[start:end])
    return ctx.admission.lookup(hash(key), stored)


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
