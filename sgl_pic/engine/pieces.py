"""Chunked requests longer than one prefill piece: planned once, run piece by piece.

SGLang splits an extend longer than ``--chunked-prefill-size`` (or what is left of a busy
batch's token budget) into pieces, one per batch, and allocates each piece's slots when it
runs. The request is planned at its first piece over its whole prompt, as if unsplit:
a scratch row of SGLang's request table stands for the prompt, holding the request's own
slots up to the first piece's end and slots taken from the allocator past it (held until
the last piece). Every step of the unsplit path runs over that row in the first piece's
batch: lookups, assembly, phase 1 for every miss, the signals with the real question, the
selection. Each piece then runs phase 2 for the selected positions inside it, over the
scratch row, and a later piece's positions are copied into the slots SGLang gave it.

Causal attention makes the pieces' sum the unsplit request: a recomputed position attends
only to positions before it, whose KV (reused, encoded, or recomputed by an earlier piece)
is final by the time its piece runs. So the recomputed set and the output do not depend on
where SGLang cut the prompt.

``PiecePlans`` owns the carried plans (worker side, the scheduler's forward thread; the
scheduler side drops a request's plan when SGLang ends it). Held slots are reported to
SGLang's memory accounting as protected (``held_tokens``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sgl_pic.core.runs import Run
from sgl_pic.engine.chunk_nodes import take_slots
from sgl_pic.engine.kv_access import KVAccess

logger = logging.getLogger(__name__)


class Reservation(NamedTuple):
    """A first piece's scratch row: positions below ``first_end`` are the request's own
    slots, ``first_end``..``num_tokens``-1 the ``scratch`` slots (# [m], m >= their count:
    whole pages)."""

    row: int
    scratch: torch.Tensor  # [m] pool slots
    first_end: int
    num_tokens: int


@dataclass
class CarriedPlan:
    """A request's plan between its pieces. ``runs``: its phase-2 runs over the whole
    prompt; ``next_start``: where the next piece must start (else the plan is dropped)."""

    reservation: Reservation
    runs: tuple[Run, ...]
    next_start: int

    @property
    def row(self) -> int:
        return self.reservation.row

    @property
    def num_tokens(self) -> int:
        return self.reservation.num_tokens


def clip(runs: Sequence[Run], start: int, end: int) -> list[Run]:
    """The parts of ``runs`` inside positions [start, end)."""
    out = []
    for run in runs:
        a, z = max(run.start, start), min(run.end, end)
        if a < z:
            out.append(Run(a, z))
    return out


class PiecePlans:
    """req_to_token: SGLang's request table # [max_reqs, max_len].
    take_rows / free_rows: rows of that table (``PhaseRunner.scratch_rows``/``free_rows``).
    allocator: SGLang's token-to-KV allocator (``alloc(n)`` -> # [n] slots or None,
               ``free(slots)``, ``page_size``).
    make_room(n): frees at least ``n`` pool slots where it can (the radix cache's eviction:
               SGLang's prefix tree, then unlocked chunk nodes), tried once when the
               allocator is short.
    kv:        copies a piece's KV from the scratch row into the request's slots.
    Worker side, on the forward thread; ``drop`` also from the scheduler side when SGLang
    ends a request (the same thread on a CPU; SGLang's overlap scheduler never ends a
    request that a forward in flight holds)."""

    def __init__(
        self,
        req_to_token: torch.Tensor,  # [max_reqs, max_len]
        take_rows: Callable[[int], list[int] | None],
        free_rows: Callable[[list[int]], None],
        allocator: Any,
        make_room: Callable[[int], int],
        kv: KVAccess,
    ) -> None:
        self.req_to_token = req_to_token
        self.take_rows = take_rows
        self.free_rows = free_rows
        self.allocator = allocator
        self.make_room = make_room
        self.kv = kv
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self._carried: dict[str, CarriedPlan] = {}
        self._held = 0

    # ------------------------------------------------------------------ reading
    def get(self, rid: str) -> CarriedPlan | None:
        """The plan carried for ``rid`` from its earlier pieces, or None."""
        return self._carried.get(rid)

    @property
    def held_tokens(self) -> int:
        """Slots held by reservations, carried or being planned (protected: not free,
        not evictable)."""
        return self._held

    def __len__(self) -> int:
        return len(self._carried)

    # ------------------------------------------------------------------ lifecycle
    def reserve(self, live_row: int, first_end: int, num_tokens: int) -> Reservation | None:
        """A scratch row for a request whose first piece ends at ``first_end`` of its
        ``num_tokens``: its own slots up to ``first_end`` (from ``live_row``), new slots
        past it. None when SGLang has no free row or slots, or the piece does not end on a
        page boundary (the piece then runs as SGLang would)."""
        if first_end % self.page_size:
            # Scratch slots start a page of their own: a paged backend would read the
            # first piece's partial page through them.
            return None
        rows = self.take_rows(1)
        if not rows:
            return None
        slots = take_slots(self.allocator, num_tokens - first_end, self.make_room)
        if slots is None:
            self.free_rows(rows)
            return None
        row = rows[0]
        table = self.req_to_token
        table[row, :first_end] = table[live_row, :first_end]
        table[row, first_end:num_tokens] = slots[: num_tokens - first_end].to(table.dtype)
        self._held += int(slots.numel())
        return Reservation(row, slots, first_end, num_tokens)

    def keep(self, rid: str, reservation: Reservation, runs: Sequence[Run]) -> None:
        """Carries a first piece's plan to the request's next pieces (after its batch
        ran)."""
        self._carried[rid] = CarriedPlan(reservation, tuple(runs), reservation.first_end)

    def advance(
        self,
        rid: str,
        live_row: int,
        start: int,
        end: int,
    ) -> None:
        """After a later piece [start, end) ran over the scratch row: its KV goes into the
        slots SGLang gave it (row ``live_row``); the plan is released after the last
        piece."""
        plan = self._carried[rid]
        src = self.req_to_token[plan.row, start:end].to(torch.int64)
        dst = self.req_to_token[live_row, start:end].to(torch.int64)
        self.kv.copy_rotated(src, dst, torch.zeros_like(src))
        plan.next_start = end
        if end >= plan.num_tokens:
            self.drop(rid)

    def release(self, reservation: Reservation) -> None:
        """Gives a reservation's row and slots back."""
        self.free_rows([reservation.row])
        self.allocator.free(reservation.scratch)
        self._held -= int(reservation.scratch.numel())

    def drop(self, rid: str) -> None:
        """Forgets ``rid``'s carried plan and gives its row and slots back (none: nothing
        happens). Called after the last piece, when a piece cannot follow the plan, and
        when SGLang ends the request."""
        plan = self._carried.pop(rid, None)
        if plan is not None:
            self.release(plan.reservation)

    def forget_all(self) -> None:
        """Forgets every carried plan without giving anything back: SGLang's flush resets
        the allocator and the request table itself (it flushes only with no request in
        flight, so none is carried then)."""
        self._carried.clear()
        self._held = 0
