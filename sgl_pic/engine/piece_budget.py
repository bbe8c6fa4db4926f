"""Phase 1 of a first prefill piece, within the budget SGLang gave that piece.

A request SGLang cuts into prefill pieces is planned whole at its first piece (``pieces``):
lookups, phase 1 and selection over its whole prompt, in that piece's batch. Phase 1 there
is bounded by the piece's budget, its extend length (what SGLang charged the piece, at most
``--chunked-prefill-size``): the prompt's misses are taken in prompt order while the tokens
phase 1 runs for them fit it (the chunk whole, and its encoding context where phase 1
computes that with it, ``encode_tokens``). The first miss that does not fit, and every miss
after it, is deferred as store admission defers a chunk: computed in context by phase 2 in
the piece where it lies, like fresh text, and not stored this time. A later request that
repeats them finds the earlier ones stored and spends its budget on the next ones.

The first miss is taken whatever its size: otherwise a chunk longer than a piece would never
be stored by a split request, and each request would store nothing until the piece grows.
A batch's phase 1 is then at most its budget or one chunk (with its context).

A request taken whole is not bounded here: SGLang takes it whole only where its planned
cost, phase 1 included, fits the budget (``binding.cost_adder``). The decision reads the
plan alone (its piece, device prefix and marks) and the misses the tensor-parallel ranks
agreed on (``lookup.Lookup``), so every rank decides alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgl_pic.engine.planner import RequestPlan


def encode_tokens(plan: RequestPlan, start: int, end: int) -> int:
    """Tokens phase 1 runs to encode the miss [start, end) of ``plan``: the chunk whole (a
    chunk the device prefix cuts is encoded whole too), plus its encoding context where
    phase 1 computes it with the chunk (``gate.Pending.context_computed``)."""
    pending = plan.pending
    context = pending.context_for(start).end if pending.context_computed(start, plan.prefix) else 0
    return end - start + context


def piece_budget(plan: RequestPlan) -> int | None:
    """The tokens phase 1 may encode for ``plan`` in this batch: its first piece's extend
    length, or None (unbounded) for a request taken whole."""
    if not plan.first_piece:
        return None
    assert plan.piece_end is not None
    return plan.piece_end - plan.prefix


def within_budget(plan: RequestPlan, misses: Sequence[tuple[int, int]]) -> list[bool]:
    """For each of ``plan``'s misses ([start, end), in prompt order, each one phase 1 would
    otherwise encode), whether phase 1 encodes it in this batch: all of them for a request
    taken whole; for a first piece, the first one, then each while the running total of
    ``encode_tokens`` fits ``piece_budget``, and none after the first that does not."""
    budget = piece_budget(plan)
    if budget is None:
        return [True] * len(misses)
    out: list[bool] = []
    spent = 0
    open_ = True
    for i, (start, end) in enumerate(misses):
        cost = encode_tokens(plan, start, end)
        open_ = open_ and (i == 0 or spent + cost <= budget)
        if open_:
            spent += cost
        out.append(open_)
    return out
