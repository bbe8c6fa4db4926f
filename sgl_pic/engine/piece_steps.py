"""What a batch does for requests split into prefill pieces (``pieces``): their first
pieces' scratch rows reserved before the steps and carried (or given back) after them
(``SplitRequests``), and the step between selection and phase 2 that cuts a first piece's
runs to the piece (``FirstPieces``)."""

from __future__ import annotations

import logging

from sgl_pic.core.metrics import PicMetrics
from sgl_pic.engine.batch import BatchContext, ChunkSpec, PieceSpec, Plans
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.pieces import PiecePlans, Reservation, clip
from sgl_pic.engine.rank_agreement import RankAgreement

logger = logging.getLogger(__name__)


class SplitRequests:
    """plans:  the carried plans (``PiecePlans``, their owner).
    ranks:     agrees a first piece's reservation over tensor-parallel ranks.
    metrics:   counts split requests, pieces and the first pieces that found no room.
    Worker side: the executor calls ``reserve`` and ``later_pieces`` before a batch's
    steps, then ``commit`` after them or ``abandon`` when they failed."""

    def __init__(self, plans: PiecePlans, ranks: RankAgreement, metrics: PicMetrics) -> None:
        self.plans = plans
        self.ranks = ranks
        self.metrics = metrics
        # First pieces' reservations while their batch runs, by scratch row.
        self._reserved: dict[int, Reservation] = {}

    def reserve(self, specs: dict[int, ChunkSpec]) -> dict[int, ChunkSpec]:
        """``specs`` with each first piece moved onto a scratch row for its whole prompt
        (``PiecePlans.reserve``); a first piece that gets none (on any tensor-parallel
        rank: all ranks plan it over its pieces, or none does) runs as SGLang would,
        counted as a fallback."""
        first = [b for b, spec in specs.items() if spec.first_piece]
        got = {
            b: self.plans.reserve(
                specs[b].pool_idx, specs[b].piece_end, len(specs[b].pending.token_ids)
            )
            for b in first
        }
        ok = self.ranks.all_of([got[b] is not None for b in first])
        agreed = dict(zip(first, ok, strict=True))
        out: dict[int, ChunkSpec] = {}
        for b, spec in specs.items():
            if not spec.first_piece:
                out[b] = spec
                continue
            reservation = got[b]
            if reservation is not None and not agreed[b]:
                self.plans.release(reservation)
                reservation = None
            if reservation is None:
                logger.warning(
                    "sgl_pic: no scratch row or slots for a request planned over several "
                    "prefill pieces; this piece runs without reuse"
                )
                self.metrics.fallbacks.inc()
                continue
            self._reserved[reservation.row] = reservation
            out[b] = spec._replace(pool_idx=reservation.row)
        return out

    def later_pieces(self, pieces: dict[int, PieceSpec], ctx: BatchContext) -> None:
        """Each later piece's share of its carried runs, over its scratch row, into
        ``ctx.runs`` and ``ctx.rows`` (phase 2 reads them); the scratch row's positions
        before the piece are pointed at the request's own slots again."""
        table = self.plans.req_to_token
        for b, piece in pieces.items():
            ctx.runs[b] = clip(piece.carried.runs, piece.start, piece.end)
            ctx.rows[b] = piece.carried.row
            # The request's own row is the truth for what lies before this piece: between
            # pieces SGLang inserts the request's KV into its prefix tree, where a copy
            # already held replaces (and frees) the request's own slots.
            table[piece.carried.row, : piece.start] = table[piece.live_row, : piece.start]

    def commit(
        self, specs: dict[int, ChunkSpec], pieces: dict[int, PieceSpec], ctx: BatchContext
    ) -> None:
        """After the batch ran: first pieces' plans carried to their next pieces, later
        pieces' KV copied into their slots (``PiecePlans.advance``)."""
        rids = ctx.live.rids
        for b, spec in specs.items():
            if spec.first_piece:
                reservation = self._reserved.pop(spec.pool_idx)
                self.plans.keep(rids[b], reservation, ctx.full_runs[b])
                self.metrics.split_requests.inc()
        for piece in pieces.values():
            self.plans.advance(piece.rid, piece.live_row, piece.start, piece.end)
        self.metrics.pieces.inc(len(pieces) + sum(s.first_piece for s in specs.values()))

    def abandon(self, specs: dict[int, ChunkSpec], pieces: dict[int, PieceSpec]) -> None:
        """After the batch failed (the runtime reruns it as SGLang would): first pieces'
        reservations given back; later pieces' plans dropped, since the rerun left their
        KV out of the scratch row."""
        for spec in specs.values():
            if spec.first_piece:
                self.plans.release(self._reserved.pop(spec.pool_idx))
        for piece in pieces.values():
            self.plans.drop(piece.rid)


class FirstPieces:
    """Reads: each first piece's runs (``Select``), device prefix, piece end and
    lower-tier hits. Writes: ``ctx.full_runs`` (its runs over the whole prompt),
    ``ctx.runs`` (those inside the piece), ``ctx.rows`` (its scratch row); loads its
    lower-tier chunks whole into the scratch row now, since their positions in later
    pieces are read before those pieces run (they are still promoted after the batch)."""

    def __init__(self, forwards: PhaseForwards) -> None:
        self.forwards = forwards

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        fw = self.forwards
        for b, plan in plans.items():
            if not plan.first_piece:
                continue
            assert plan.piece_end is not None
            fw.load_whole(plan)
            ctx.full_runs[b] = ctx.runs[b]
            ctx.runs[b] = clip(ctx.runs[b], plan.prefix, plan.piece_end)
            ctx.rows[b] = plan.pool_idx
