"""What every tensor-parallel rank decides alike for a chunked batch, decided once for all.

With ``--tp-size`` > 1 each rank runs its own scheduler over the same batches, but holds
chunk nodes, host memory and disk of its own (its shard of the heads): a chunk one rank
holds another may have evicted, a record may be damaged on one disk only, a deletion read
from the shared log may have reached one rank first. A rank that then took another path
(a miss encoded in phase 1 where the others reuse, a retry the others do not take) would
run forwards the others do not, and their collectives would stall. So the choices that
shape a batch's forwards are put to every rank before they are acted on:

- per chunk looked up, where it is reused from: the slowest tier any rank holds it in, a
  miss where any rank misses it, no stored ranking where any rank has none
  (``agree_chunks``); a rank that found it faster reads its own copy, it is only counted
  and planned (CacheTune's r per tier) as the agreed tier;
- per miss, whether store admission stores it: only where every rank would (``all_of``);
- after phase 2, whether a stored chunk failed its checks while loading on any rank
  (``any_of``): all ranks then retry the batch, or all fall back, together;
- whether any rank failed: a rank whose batch raised outside a forward calls ``fail``,
  which meets the others at their next collective of the batch (every agreement here, every
  phase forward and every TP reduce starts with ``proceed``, and the batch ends with one):
  they raise ``PeerFailed``, and every rank runs the batch as plain prefill, together.

The stored rankings themselves are not put to the ranks: phase 1 computes each from every
rank's heads (its all-reduced scores), so every rank stores the same one.

``reduce_max`` takes a small # [n] int64 host tensor and returns its elementwise maximum
over the ranks (SGLang's TP group's CPU group, as SGLang's scheduler agrees on the requests
it rejects; ``binding.plugin``). None on one rank: every decision is the rank's own. Every
rank must make the same calls in the same order with the same lengths; the lengths here
follow from what SGLang's scheduler replicas share (each batch's requests, their device
prefixes) and from earlier agreed results only, never from a rank's own tiers.

Scheduler side: called on the forward thread by ``lookup.Lookup`` (before anything is
encoded or loaded) and by ``executor.ChunkExecutor`` (after phase 2's forward, before the
batch's output is used). Results are safe to act on as soon as a call returns: every rank
got the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from sgl_pic.engine.planner import TIERS

# Elementwise maximum over the ranks of # [n] int64 host tensor (in place or returned).
ReduceMax = Callable[[torch.Tensor], torch.Tensor]

# A miss ranks after every tier: the maximum over the ranks is a miss where any rank missed.
MISS = len(TIERS)


class ChunkVote(NamedTuple):
    """One chunk as one rank found it, or as all ranks agreed on it: the tier it is reused
    from (None: a miss) and whether that tier holds a ranking of it."""

    tier: str | None
    ranked: bool


class PeerFailed(RuntimeError):
    """Another tensor-parallel rank's batch failed; this rank falls back with it."""


class RankAgreement:
    """The one owner of the collective decisions of a scheduler's chunked batches (see the
    module docstring). ``reduce_max``: see there; None on one rank."""

    def __init__(self, reduce_max: ReduceMax | None = None) -> None:
        self.reduce_max = reduce_max

    @property
    def shared(self) -> bool:
        """Whether other ranks take part (a collective runs on each call)."""
        return self.reduce_max is not None

    def agree_chunks(self, votes: Sequence[ChunkVote]) -> list[ChunkVote]:
        """Per chunk, in order: the slowest tier any rank holds it in (None where any rank
        misses it), ranked only where every rank has a ranking. One collective."""
        codes = [MISS if v.tier is None else TIERS.index(v.tier) for v in votes]
        unranked = [int(not v.ranked) for v in votes]
        agreed = self._max(codes + unranked)
        n = len(votes)
        return [
            ChunkVote(None if c == MISS else TIERS[c], not u)
            for c, u in zip(agreed[:n], agreed[n:], strict=True)
        ]

    def all_of(self, flags: Sequence[bool]) -> list[bool]:
        """Per flag, True only where every rank's is True. One collective."""
        return [not f for f in self._max([int(not f) for f in flags])]

    def any_of(self, flag: bool) -> bool:
        """Whether any rank's ``flag`` is True. One collective."""
        return bool(self._max([int(flag)])[0])

    def proceed(self) -> None:
        """Before each collective of a chunked batch (and at its end): raises
        ``PeerFailed`` when another rank failed this batch (its ``fail``). One collective;
        nothing on one rank."""
        if self.reduce_max is not None and self._reduce([0])[0]:
            raise PeerFailed("another tensor-parallel rank failed this batch")

    def fail(self) -> None:
        """Called once by a rank whose batch raised anything but ``PeerFailed``, before it
        falls back: meets the other ranks' next ``proceed`` (or their own ``fail``, where
        the failure was agreed and all raised it), so no rank is left in a collective the
        others never join. Nothing on one rank."""
        if self.reduce_max is not None:
            self._reduce([1])

    def _max(self, values: list[int]) -> list[int]:
        """Elementwise maximum of ``values`` over the ranks, after ``proceed``. An empty
        list is agreed without a collective: every rank has an empty one (see the module
        docstring)."""
        if self.reduce_max is None or not values:
            return values
        self.proceed()
        return self._reduce(values)

    def _reduce(self, values: list[int]) -> list[int]:
        assert self.reduce_max is not None
        t = torch.tensor(values, dtype=torch.int64)  # host: a handful of decisions
        return [int(x) for x in self.reduce_max(t).tolist()]
