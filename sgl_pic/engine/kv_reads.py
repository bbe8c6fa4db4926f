"""How much KV an attention plan reads: the paged GPU backends' plans, and the reference
that bounds phase 2's.

Phase 2 runs each run of recomputed positions as its own extend sub-request (prefix: its
row up to the run's start), and the paged prefill kernels of FlashInfer and FA3 read a
sub-request's KV once per query tile: a prompt of many short runs reads its prefix once
per run, where an exact prefill reads it once per tile of the whole prompt. Counted here
in KV tokens per KV head and layer (every head and layer reads alike), so plans compare
by one number.

Facts each model rests on (the kernels' planning as SGLang 0.5.23 calls them: page size
1, no sliding window, no custom mask; FlashInfer's ``attention/scheduler.cuh`` and
``utils.cuh``, FA3's ``hopper/tile_size.h``, ``heuristics.h`` and its causal block range):

- Both kernels pack the query heads that share a KV head into one tile's rows (token t,
  head h of the group is row t * group + h): FlashInfer always in prefill (its plan's
  ``packed_qo_len = qo_len * group_size``), FA3 whenever queries are varlen
  (``should_pack_gqa`` returns true for ``cu_seqlens_q``, which SGLang always passes).
  A tile of ``rows`` rows covers ``rows / group`` tokens of one KV head.
- Causal tiles skip masked KV: a tile reads the sub-request's KV up to its last query
  (``kv_len - qo_len + ceil(rows * (m + 1) / group)`` for tile m), FlashInfer in whole
  tokens, FA3 in blocks of ``kBlockN`` tokens from the row's start (its ``n_block_max``);
  both stop at ``kv_len``.
- FlashInfer (``FA2DetermineCtaTileQ``, non-CUDA-graph plan, sm80 and newer) picks one
  tile for the whole batch from the average packed query length over its sub-requests
  (integer division): 128 rows above 64 (head_dim < 256), 64 rows above 16, else 16.
- FA3 on sm90 (``tile_size_fwd_sm90``, 16-bit inputs, causal, paged KV without TMA at page
  size 1): ``kBlockM`` 192 rows and ``kBlockN`` 128 for head_dim <= 64, 128 x 128 up to
  head_dim 256; one tile per sub-request, whatever its batch.
- Split-KV partitions a tile's KV between blocks; it reads the same KV, so it is left out.

Exact prefill, the comparison: one sub-request over the request's positions past its
device prefix, planned alone (chunked prefill reads a little more; not modelled).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

BACKENDS: tuple[str, ...] = ("flashinfer", "fa3")


class AttnShape(NamedTuple):
    """What of a model's attention the plans depend on, per tensor-parallel rank."""

    group: int  # query heads per KV head
    head_dim: int


class TilePlan(NamedTuple):
    """One kernel's tiling of a sub-request: ``rows`` packed query rows per tile,
    ``group`` query heads per KV head, KV read in blocks of ``block_kv`` tokens."""

    rows: int
    group: int
    block_kv: int = 1


class SubRequest(NamedTuple):
    """An extend sub-request as a plan sees it: ``prefix`` tokens of KV before its
    ``extend`` queries (which attend causally through their own positions)."""

    prefix: int
    extend: int


def tile_reads(sub: SubRequest, tile: TilePlan) -> int:
    """KV tokens the causal tiles of one sub-request read."""
    kv_len = sub.prefix + sub.extend
    total = 0
    for m in range(math.ceil(sub.extend * tile.group / tile.rows)):
        last = min(sub.extend, math.ceil(tile.rows * (m + 1) / tile.group))
        end = sub.prefix + last
        total += min(kv_len, math.ceil(end / tile.block_kv) * tile.block_kv)
    return total


def flashinfer_rows(avg_packed: int, head_dim: int) -> int:
    """FlashInfer's query tile (rows) for a batch whose sub-requests average
    ``avg_packed`` packed query rows."""
    if avg_packed > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed > 16 else 16


def fa3_rows(head_dim: int) -> int:
    """FA3's query tile (rows, ``kBlockM``) on sm90 for a causal paged extend."""
    return 192 if head_dim <= 64 else 128


def flashinfer_tile(subs: Sequence[SubRequest], shape: AttnShape) -> TilePlan:
    """The tile FlashInfer's prefill plan picks for the batch ``subs``."""
    avg = sum(s.extend * shape.group for s in subs) // max(1, len(subs))
    return TilePlan(flashinfer_rows(avg, shape.head_dim), shape.group)


def fa3_tile(shape: AttnShape) -> TilePlan:
    """FA3's tile for a causal paged extend (head_dim <= 256), whatever the batch."""
    return TilePlan(fa3_rows(shape.head_dim), shape.group, 128)


def planned_reads(backend: str, subs: Sequence[SubRequest], shape: AttnShape) -> int:
    """KV tokens ``backend``'s plan of the batch ``subs`` reads (per KV head, layer)."""
    if backend == "flashinfer":
        tile = flashinfer_tile(subs, shape)
    elif backend == "fa3":
        tile = fa3_tile(shape)
    else:
        raise ValueError(f"no read model for backend {backend!r}; known: {', '.join(BACKENDS)}")
    return sum(tile_reads(s, tile) for s in subs)


def exact_reads(backend: str, num_tokens: int, shape: AttnShape, prefix: int = 0) -> int:
    """KV tokens an exact prefill of positions prefix..num_tokens-1 reads, planned alone."""
    return planned_reads(backend, [SubRequest(prefix, num_tokens - prefix)], shape)


def reference_reads(prefix: int, extend: int, tile_tokens: int) -> int:
    """KV tokens a sub-request reads in causal tiles of ``tile_tokens`` tokens: tile m
    reads through position prefix + min(extend, (m + 1) * tile_tokens); closed form."""
    if extend <= 0:
        return 0
    tiles = -(-extend // tile_tokens)
    return tiles * prefix + tile_tokens * tiles * (tiles - 1) // 2 + extend


# The plans a ``ReadCap`` holds phase 2 to, in the order of ``ReadCap.tiles``: FA3's, then
# FlashInfer's at each tile it may pick.
FLASHINFER_ROWS: tuple[int, ...] = (16, 64, 128)


class ReadCap(NamedTuple):
    """Phase 2's bound, the same on every backend: a request of at least ``min_tokens``
    tokens has its runs, planned as a batch of their own, read at most ``budget`` times
    its exact prefill on FA3's plan and on FlashInfer's (whichever tile the runs' average
    length makes it pick), for a model of ``group`` query heads per KV head and
    ``head_dim``. Counted by ``reference_reads`` in whole tokens per tile (rows // group:
    a close approximation where the group does not divide the rows); its budget leaves
    room for that and for FA3's KV blocks. Shorter requests are not bounded: their
    prefix reads are small next to the recomputation merging would add."""

    group: int
    head_dim: int
    budget: float
    min_tokens: int = 0

    def binds(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens is bounded."""
        return num_tokens >= self.min_tokens

    @property
    def tiles(self) -> tuple[int, ...]:
        """Tokens per query tile: FA3's, then FlashInfer's 16-, 64- and 128-row tiles."""
        rows = (fa3_rows(self.head_dim), *FLASHINFER_ROWS)
        return tuple(max(1, r // self.group) for r in rows)

    def reads(self, prefix: int, extend: int) -> tuple[int, ...]:
        """A sub-request's ``reference_reads`` at each of ``tiles``."""
        return tuple(reference_reads(prefix, extend, t) for t in self.tiles)

    def flashinfer_index(self, tokens: int, subrequests: int) -> int:
        """Where in ``tiles`` FlashInfer's tile for ``subrequests`` of ``tokens`` in all."""
        rows = flashinfer_rows(tokens * self.group // max(1, subrequests), self.head_dim)
        return 1 + FLASHINFER_ROWS.index(rows)

    def limits(self, prefix: int, num_tokens: int) -> tuple[float, float]:
        """The most FA3's and FlashInfer's plans may read for a request of positions
        prefix..num_tokens-1: ``budget`` times its exact prefill on each."""
        exact = self.reads(prefix, num_tokens - prefix)
        fi = self.flashinfer_index(num_tokens - prefix, 1)
        return self.budget * exact[0], self.budget * exact[fi]

    def holds(
        self, reads: Sequence[int], tokens: int, subrequests: int, limits: tuple[float, float]
    ) -> bool:
        """Whether ``subrequests`` runs of ``tokens`` in all, reading ``reads`` at each of
        ``tiles``, keep within ``limits``."""
        fi = self.flashinfer_index(tokens, subrequests)
        return reads[0] <= limits[0] and reads[fi] <= limits[1]


def read_cap(group: int, head_dim: int, budget: float, min_tokens: int = 0) -> ReadCap | None:
    """The cap for a model of ``group`` query heads per KV head (per rank) and
    ``head_dim``, binding requests of at least ``min_tokens`` tokens; None when ``budget``
    is 0 (no cap)."""
    return ReadCap(max(1, group), head_dim, budget, min_tokens) if budget > 0 else None
