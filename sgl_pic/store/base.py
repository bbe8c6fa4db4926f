"""The chunk-store interface, the record it holds, and the registry of implementations.

A store maps a segment key (``SegmentKey.digest`` from ``sgl_pic.keys``) to one
immutable ``ChunkKV``: the segment's keys (stored before RoPE), values, token ids and
optional CacheTune ranking. Keys are content hashes, so a key never names two
different records; ``put`` of a key already held is a no-op.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from sgl_pic.registry import STORES
from sgl_pic.store.errors import LayoutMismatchError, RecordShapeError

# Names used in file headers and configs; the store never guesses a dtype from bytes.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)
DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({v: k for k, v in DTYPES.items()})

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_key(key: str) -> str:
    """``key`` if it is a 64-digit lowercase hex digest; file names derive from it, so
    anything else (a path, a request string) is refused here."""
    if not isinstance(key, str) or not _HEX64.match(key):
        raise ValueError(f"a store key is a 64-digit lowercase hex digest, got {key!r}")
    return key


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is "" (the default) or a 64-digit lowercase hex digest."""
    if namespace != "":
        check_key(namespace)
    return namespace


# Joins a record's content digests (``record_content``).
CONTENT_SEPARATOR = "+"


def record_content(token_ids_hash: str, context_contents: Sequence[str] = ()) -> str:
    """What a deletion by content matches a record by (``deletion.Deletion``): its
    segment's digest, then those of the first chunk it was encoded after, if any: its K/V
    carry what attention took from that chunk, so deleting either deletes it."""
    return CONTENT_SEPARATOR.join((token_ids_hash, *context_contents))


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """SHA-256 of the token ids as little-endian uint32 (the encoding of sgl_pic.keys)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("token ids must fit in uint32")
    return hashlib.sha256(arr.astype("<u4").tobytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class ChunkKV:
    """One cached chunk segment. Immutable by contract: tensors handed out by a store
    may be shared with it, so nobody writes into them; rotation and recomputation work
    on the request's own copies (``LayerKV`` tensors are always copies).

    key:          SegmentKey.digest, 64 lowercase hex digits.
    model_digest: ModelFingerprint.digest() of the model that produced the KV.
    token_ids:    the segment's tokens.
    k:            # [num_layers, num_tokens, num_kv_heads, head_dim], before RoPE.
    v:            # [num_layers, num_tokens, num_kv_heads, head_dim]
    ranking:      # [num_tokens] float32 CacheTune ranking (higher = recompute first),
                  or None.
    layer_start:  model layer of ``k[0]``; the record holds layers
                  [layer_start, layer_start + num_layers) (pipeline-parallel shards).
    namespace:    the isolation namespace (tenant) the record was stored under: "" (the
                  default) or a 64-digit hex digest (``sgl_pic.core.tenants``). The
                  key already names it; it is kept beside the KV so that a tenant's records
                  can be found without knowing their tokens.
    context_contents: content digests of the segments of the first chunk this one was
                  encoded after (``PicConfig.chunk_context``), () for a chunk encoded
                  alone: a deletion of that chunk's content deletes this record too.
    """

    key: str
    model_digest: str
    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    ranking: torch.Tensor | None = None
    layer_start: int = 0
    namespace: str = ""
    context_contents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_key(self.key)
        check_key(self.model_digest)
        check_namespace(self.namespace)
        object.__setattr__(
            self, "context_contents", tuple(check_key(c) for c in self.context_contents)
        )
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise RecordShapeError(
                f"k and v must share a 4-d shape [layers, tokens, heads, head_dim], "
                f"got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
            )
        if self.k.dtype != self.v.dtype or self.k.dtype not in DTYPE_NAMES:
            raise RecordShapeError(
                f"k/v dtype must be one of {sorted(DTYPES)} and equal, "
                f"got {self.k.dtype} and {self.v.dtype}"
            )
        if min(self.k.shape) < 1:
            raise RecordShapeError(f"empty KV shape {tuple(self.k.shape)}")
        if len(self.token_ids) != self.k.shape[1]:
            raise RecordShapeError(
                f"{len(self.token_ids)} token ids for {self.k.shape[1]} KV tokens"
            )
        if self.ranking is not None and tuple(self.ranking.shape) != (self.k.shape[1],):
            raise RecordShapeError(
                f"ranking shape {tuple(self.ranking.shape)} != ({self.k.shape[1]},)"
            )
        if self.layer_start < 0:
            raise RecordShapeError(f"layer_start must be >= 0, got {self.layer_start}")

    def content(self) -> str:
        """``record_content`` of this record (hashes its tokens: call once per use)."""
        return record_content(hash_token_ids(self.token_ids), self.context_contents)

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_start + self.num_layers)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.k.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return int(self.k.shape[2] * self.k.shape[3] * self.k.element_size())

    @property
    def nbytes(self) -> int:
        """Payload bytes (K and V, all layers); the unit of every capacity."""
        return 2 * self.num_layers * self.num_tokens * self.row_bytes


@dataclass(frozen=True)
class RecordLayout:
    """The KV layout every record of a store must have: the serving model's KV pool's.

    The key and model digest say whose KV a record claims to be; only this says whether
    its bytes fit the pool they are loaded into. A record that does not fit is bad (see
    ``LayoutMismatchError``), however well-formed its file.

    layer_start / num_layers: the model layers the records hold (the pool's).
    num_kv_heads / head_dim:  one token's row in one layer of the pool.
    dtype:                    element type name (a ``DTYPES`` key) of the pool.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layer_start: int = 0

    def check(
        self, layer_start: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str
    ) -> None:
        """Raises ``LayoutMismatchError`` unless the given layout is this one."""
        got = (layer_start, num_layers, num_kv_heads, head_dim, dtype)
        want = (self.layer_start, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        if got != want:
            raise LayoutMismatchError(
                "record layout (layer_start, layers, kv_heads, head_dim, dtype) = "
                f"{got}, the KV pool's is {want}"
            )

    def check_header(self, h: Any) -> None:
        """``check`` of a ``format.RecordHeader``."""
        self.check(h.layer_start, h.num_layers, h.num_kv_heads, h.head_dim, h.dtype)

    def check_record(self, r: ChunkKV) -> None:
        """``check`` of a ``ChunkKV``."""
        self.check(r.layer_start, r.num_layers, int(r.k.shape[2]), int(r.k.shape[3]), r.dtype_name)


@dataclass(frozen=True, eq=False)
class LayerKV:
    """A layer range and token subset of one record, as copies the caller owns.

    layers:         absolute model layers held, in order.
    token_indices:  # [n] int64 sorted unique token indices local to the chunk.
    k:              # [len(layers), n, num_kv_heads, head_dim], before RoPE.
    v:              # [len(layers), n, num_kv_heads, head_dim]
    bytes_read:     payload bytes moved out of the tier for this result (K and V).
    """

    key: str
    layers: range
    token_indices: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bytes_read: int


class EvictResult(NamedTuple):
    keys: tuple[str, ...]
    freed_bytes: int


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one tier's counters; later activity does not change it.

    errors: counts per kind of failure (e.g. "corrupt", "truncated", "foreign_model",
    "newer_format", "token_mismatch", "unreadable", "write_error", "enospc").
    """

    entries: int
    bytes_used: int
    capacity_bytes: int
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected_puts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    bytes_read: int = 0
    errors: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


def normalize_indices(
    token_indices: torch.Tensor | Sequence[int] | None,  # [n] int
    num_tokens: int,
) -> torch.Tensor:
    """# [n] int64 sorted unique indices in [0, num_tokens); all tokens when None."""
    if token_indices is None:
        # Record rows are addressed on the host: records live in host memory or on disk.
        return torch.arange(num_tokens, dtype=torch.int64, device="cpu")
    idx = torch.unique(torch.as_tensor(token_indices, dtype=torch.int64, device="cpu").flatten())
    if idx.numel() and (idx[0] < 0 or idx[-1] >= num_tokens):
        raise RecordShapeError(f"token indices outside [0, {num_tokens})")
    return idx


def layer_offsets(held: range, wanted: range) -> range:
    """Positions inside a record holding ``held`` layers of the ``wanted`` layers."""
    if wanted.step != 1 or len(wanted) == 0:
        raise RecordShapeError(f"layer range must be non-empty with step 1, got {wanted}")
    if wanted.start < held.start or wanted.stop > held.stop:
        raise RecordShapeError(f"layers {wanted} are not all in the record's {held}")
    return range(wanted.start - held.start, wanted.stop - held.start)


class ChunkStore(ABC):
    """One tier (or a stack of tiers) of immutable chunk records.

    Thread safety: every method may be called from any thread.
    Ownership: ``put`` copies (or serialises) what it keeps, so the caller may reuse its
    tensors afterwards. ``get`` may return tensors shared with the store: read them,
    never write them. ``get_layers`` always returns copies.
    Failures: a bad record (corrupt, truncated, foreign model, wrong tokens, newer
    format, unreadable) is never served; the tier counts it in ``stats().errors``,
    drops it and answers a miss. Write failures are counted and ``put`` returns False;
    the store stays usable.

    A shared store (e.g. Redis) plugs in by implementing these methods over its own
    index: it needs an atomic set-if-absent for ``put`` (keys are content hashes, so
    the first writer wins and later writers are no-ops), server-side access timestamps
    and counts for eviction (DARIC 3.3.2 keeps both per node), a lease with expiry for
    ``lock`` so a crashed client cannot pin entries forever, and byte-range reads of
    the per-layer payload (the ``format`` layout) so ``get_layers`` stays sparse.
    """

    name: ClassVar[str]

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is held now. Changes nothing (no access count, no
        timestamp); the answer may be stale by the time the caller acts on it."""

    @abstractmethod
    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        """The record, or None on a miss. Counts a hit or miss and refreshes the
        entry's access time and count. With ``token_ids``, a record holding other
        tokens is a miss (and is dropped as bad). Safe to read until the caller drops
        it, even if the entry is evicted meanwhile; never mutate it."""

    @abstractmethod
    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        """Copies of layers ``layers`` (absolute model layers) for the tokens
        ``token_indices`` (local, any order, duplicates dropped; None = all), or None
        on a miss. Only these rows are moved; ``bytes_read`` says how many bytes.
        Counts a hit or miss like ``get``. Raises RecordShapeError when the request
        names layers or tokens the record cannot hold."""

    @abstractmethod
    def put(self, record: ChunkKV) -> bool:
        """Keep ``record``; True when it is held after the call (including when the key
        was already held). May evict unlocked entries to make room. False when the
        record cannot be kept (larger than capacity, everything else locked, foreign
        model, write failure): counted, nothing partial remains."""

    @abstractmethod
    def evict(self, nbytes: int) -> EvictResult:
        """Drop unlocked entries in policy order until at least ``nbytes`` are freed or
        none are left; returns what was dropped. Readers holding a record keep it."""

    @abstractmethod
    def lock(self, key: str) -> bool:
        """Protect ``key`` from eviction until a matching ``unlock``; locks nest.
        False (and nothing locked) when the key is not held."""

    @abstractmethod
    def unlock(self, key: str) -> None:
        """Undo one ``lock``; unlocking a key that is not locked is a no-op."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""

    @contextmanager
    def locked(self, keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
        """Lock ``keys`` for the block; yields the keys that were held and locked."""
        held = tuple(k for k in keys if self.lock(k))
        try:
            yield held
        finally:
            for k in held:
                self.unlock(k)


def register_store(cls: type[ChunkStore]) -> type[ChunkStore]:
    """Class decorator: make ``cls`` constructible as ``make_store(cls.name, ...)``
    (``sgl_pic.registry`` says how to plug in a store from outside this package)."""
    return STORES.add(cls.name, cls)


def store_names() -> tuple[str, ...]:
    """Every registered store name, in registration order."""
    return STORES.names()


def make_store(name: str, *args: Any, **kwargs: Any) -> ChunkStore:
    """The store registered as ``name``, built with its own constructor arguments
    (each takes its frozen config first, then the model digest)."""
    return STORES.get(name)(*args, **kwargs)
