"""The step between selection and phase 2 for requests planned whole at their first
prefill piece (``pieces``): their phase-2 runs are cut to the piece, the whole prompt's
kept for the pieces that follow."""

from __future__ import annotations

from sgl_pic.engine.batch import BatchContext, Plans
from sgl_pic.engine.forwards import PhaseForwards
from sgl_pic.engine.pieces import clip


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
            if plan.lower:
                fw.load_layers(plan, fw.kv.num_layers)
                plan.loaded_whole.extend(plan.lower)
                plan.lower.clear()
            ctx.full_runs[b] = ctx.runs[b]
            ctx.runs[b] = clip(ctx.runs[b], plan.prefix, plan.piece_end)
            ctx.rows[b] = plan.pool_idx
