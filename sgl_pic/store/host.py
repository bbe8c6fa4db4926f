"""Host-memory tier: a byte-capacity cache of chunk records with LRU, LFU or GDSF eviction,
locking, pinned buffers when CUDA is present, and a background write-back queue."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_pic.store.base import (
    ChunkKV,
    EvictResult,
    LayerKV,
    RecordLayout,
    layer_offsets,
    normalize_indices,
    register_store,
)
from sgl_pic.store.bounded import BoundedStore
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.eviction import check_policy
from sgl_pic.store.write_back import DrainResult, WriteBack, WriteBackConfig, WriteBackStats

WRITE_BACK_MODES: tuple[str, ...] = ("on_put", "on_evict")


@dataclass(frozen=True)
class HostStoreConfig:
    """capacity_bytes: payload bytes (K and V) the tier may hold, >= 0.
    policy:          "lru" evicts the least recently used entry first; "lfu" the least
                     often used, ties broken by recency; "gdsf" the lowest
                     greedy-dual-size-frequency priority (``sgl_pic.store.eviction``).
    pin_memory:      copy records into page-locked memory when CUDA is available, so
                     host-to-device copies can be asynchronous. Ignored without CUDA.
    write_back:      when records go to the write-back sink (if the store has one):
                     "on_put" soon after each new record arrives (write-through, off the
                     critical path), "on_evict" only when evicted (demotion).
    write_back_queue: jobs the background writer may have pending; more are dropped.
    namespace_max_bytes: payload bytes one namespace (tenant) may hold, 0 for no cap
                     (``sgl_pic.store.eviction``: fair share).
    """

    capacity_bytes: int
    policy: str = "lru"
    pin_memory: bool = True
    write_back: str = "on_put"
    write_back_queue: int = 64
    namespace_max_bytes: int = 0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        check_policy(self.policy)
        if self.write_back not in WRITE_BACK_MODES:
            raise ValueError(
                f"unknown write_back {self.write_back!r}; valid: {', '.join(WRITE_BACK_MODES)}"
            )
        if self.write_back_queue < 1:
            raise ValueError(f"write_back_queue must be >= 1, got {self.write_back_queue}")
        if self.namespace_max_bytes < 0:
            raise ValueError(f"namespace_max_bytes must be >= 0, got {self.namespace_max_bytes}")


@register_store
class HostStore(BoundedStore):
    """Records in host memory. ``get`` returns the stored record itself (no copy):
    read-only by contract.

    write_back_to: a sink (e.g. ``DiskStore.put``) that a background thread feeds with
                   records per ``config.write_back``; ``flush`` waits for it.
    write_back_since_to: instead of ``write_back_to``, a sink also given the deletion
                   sequence number (``deletions.seq``) at which the write was queued,
                   e.g. ``DiskStore.put``'s ``since``, so a deletion racing the write is
                   still seen by the sink.
    on_evict:      called with each evicted record, outside the store's lock, in the
                   evicting thread; it must not block for long.
    deletions:     the deletion log (shared with the sink's tier); a write-back of a
                   record a later deletion matches is dropped when it runs.
    """

    name: ClassVar[str] = "host"

    def __init__(
        self,
        config: HostStoreConfig,
        model_digest: str,
        write_back_to: Callable[[ChunkKV], object] | None = None,
        on_evict: Callable[[ChunkKV], None] | None = None,
        layout: RecordLayout | None = None,
        write_back_since_to: Callable[[ChunkKV, int], object] | None = None,
        deletions: DeletionLog | None = None,
    ) -> None:
        """layout: the KV layout every record must have; another is refused on put."""
        super().__init__(
            model_digest,
            config.capacity_bytes,
            config.policy,
            layout,
            config.namespace_max_bytes,
            deletions,
        )
        if write_back_to is not None and write_back_since_to is not None:
            raise ValueError("give write_back_to or write_back_since_to, not both")
        self.config = config
        self._on_evict = on_evict
        self._sink: Callable[[ChunkKV, int], object] | None = write_back_since_to
        if write_back_to is not None:
            plain = write_back_to
            self._sink = lambda record, _since: plain(record)
        self._writer = (
            None
            if self._sink is None
            else WriteBack(WriteBackConfig(config.write_back_queue), "sgl-pic-host-writeback")
        )
        self._pin = config.pin_memory and torch.cuda.is_available()
        self._records: dict[str, ChunkKV] = {}  # same keys as the index's entries

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        # The store owns its bytes: a caller reusing its buffer cannot change a record.
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
        out.copy_(t)
        return out

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        with self._lock:
            record = self._records.get(key)
            if (
                record is not None
                and token_ids is not None
                and tuple(int(t) for t in token_ids) != record.token_ids
            ):
                # Same key, other tokens: the key cannot be trusted; drop it.
                self._errors["token_mismatch"] += 1
                self._forget_locked(key)
                del self._records[key]
            if not self._access_locked(key):
                return None
            self._counts["hits"] += 1
            return self._records[key]

    def peek(self, key: str) -> ChunkKV | None:
        """The record if held, without counting an access (shared: never mutate)."""
        with self._lock:
            return self._records.get(key)

    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        record = self.get(key, token_ids)
        if record is None:
            return None
        offsets = layer_offsets(record.layers, layers)
        idx = normalize_indices(token_indices, record.num_tokens)
        # index_select copies only the requested rows; this is where the ops gather
        # kernel (pinned host -> device, one launch per layer) slots in.
        part = slice(offsets.start, offsets.stop)
        k = record.k[part].index_select(1, idx)
        v = record.v[part].index_select(1, idx)
        moved = 2 * len(offsets) * idx.numel() * record.row_bytes
        with self._lock:
            self._counts["bytes_read"] += moved
        return LayerKV(key, layers, idx, k, v, moved)

    def put(self, record: ChunkKV) -> bool:
        return self.insert(record, write_back=True)

    def insert(self, record: ChunkKV, write_back: bool, since: int | None = None) -> bool:
        """``put`` with a choice: ``write_back=False`` for records that came from the
        sink's tier (a promotion), which need not be written there again on put.

        since: ``deletions.seq`` when the caller obtained ``record`` (a promotion queued
        earlier); a deletion logged after it that matches drops the record (False).
        Default: now."""
        if since is None:
            since = self.deletions.seq
        if not self._accepts_model(record):
            return False
        content = record.content()
        with self._lock:
            if record.key in self._entries:
                return True
            if record.nbytes > self._capacity:
                self._counts["rejected_puts"] += 1
                return False
        own = ChunkKV(
            key=record.key,
            model_digest=record.model_digest,
            token_ids=record.token_ids,
            k=self._copy(record.k),
            v=self._copy(record.v),
            # On the CPU like the KV, copied synchronously: the disk writer reads it on
            # another thread, where a device tensor's pending copy would not be ordered.
            ranking=None if record.ranking is None else self._copy(record.ranking).float(),
            layer_start=record.layer_start,
            namespace=record.namespace,
            context_contents=record.context_contents,
        )
        with self._lock:
            if record.key in self._entries:
                return True
            if self._deleted_since_locked(since, record.namespace, content):
                return False
            evicted, ok = self._make_room_locked(own.nbytes, record.namespace)
            dropped = self._pop_records_locked(evicted)
            if ok:
                self._add_locked(
                    record.key, own.nbytes, namespace=record.namespace, content=content
                )
                self._records[record.key] = own
                self._counts["puts"] += 1
        if ok and write_back and self.config.write_back == "on_put":
            self._write_back(own)
        self._notify(dropped)
        return ok

    def _write_back(self, record: ChunkKV) -> None:
        """Queue ``record`` for the sink; the job drops it if a deletion logged after now
        matches it by the time it runs (the sink, given ``since``, checks again)."""
        if self._writer is None or self._sink is None:
            return
        sink, since = self._sink, self.deletions.seq

        def job() -> None:
            content = record.content  # computed only if a deletion came since
            if self.deletions.covers(since, record.namespace, content):
                with self._lock:
                    self._counts["deleted_in_flight"] += 1
                return
            sink(record, since)

        self._writer.submit(job)

    def _dropped_locked(self, keys: list[str]) -> None:
        for key in keys:
            self._records.pop(key, None)

    def flush(self) -> None:
        """Wait until every write-back submitted so far has run (tests, shutdown)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and stop the write-back thread; the store stays readable."""
        if self._writer is not None:
            self._writer.close()

    def shutdown(
        self,
        timeout_s: float,
        on_deadline: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
        join_s: float = 2.0,
    ) -> DrainResult | None:
        """``WriteBack.shutdown`` of the write-back thread (None without a sink): queued
        write-backs run until the deadline, the rest are dropped; later ones are dropped
        at submit. The store stays readable and writable in memory."""
        if self._writer is None:
            return None
        return self._writer.shutdown(timeout_s, on_deadline, stop, join_s)

    def write_back_stats(self) -> WriteBackStats | None:
        return None if self._writer is None else self._writer.stats()

    def _pop_records_locked(self, evicted: list[tuple[str, int]]) -> list[ChunkKV]:
        return [self._records.pop(key) for key, _ in evicted]

    def _notify(self, evicted: list[ChunkKV]) -> None:
        if self.config.write_back == "on_evict":
            for rec in evicted:
                self._write_back(rec)
        if self._on_evict is None:
            return
        for rec in evicted:
            try:
                self._on_evict(rec)
            except Exception:
                # Demotion is best effort: a failing lower tier must not fail a put.
                with self._lock:
                    self._errors["demote_error"] += 1

    def evict(self, nbytes: int) -> EvictResult:
        with self._lock:
            evicted = self._evict_locked(nbytes)
            dropped = self._pop_records_locked(evicted)
        self._notify(dropped)
        return EvictResult(tuple(k for k, _ in evicted), sum(n for _, n in evicted))
