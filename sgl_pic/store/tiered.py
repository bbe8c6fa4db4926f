"""Host + disk as one store: demotion of evicted host records to disk, write-back of
new records, and promotion of disk hits into host memory.

The device (GPU) tier belongs to the SGLang integration: it demotes by calling ``put``
with a record copied to the host, and may report residency through ``DeviceTier`` so
``locate`` can say where a chunk lives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal, NamedTuple, Protocol

import torch

from sgl_pic.store.base import (
    ChunkKV,
    ChunkStore,
    EvictResult,
    LayerKV,
    StoreStats,
    check_key,
    register_store,
)
from sgl_pic.store.disk import DiskStore, DiskStoreConfig
from sgl_pic.store.host import HostStore, HostStoreConfig, WriteBack, WriteBackConfig

Tier = Literal["device", "host", "disk"]


class RankingPeek(NamedTuple):
    """ranking: # [num_tokens] the record's CacheTune ranking, or None if it has none."""

    ranking: torch.Tensor | None


class DeviceTier(Protocol):
    """What the tiered store may ask the integration's device tier."""

    def contains(self, key: str) -> bool:
        """Whether ``key``'s KV is resident on the device now (no side effects)."""
        ...


@dataclass(frozen=True)
class TieredStoreConfig:
    """host / disk:          the two tiers' configs. ``host.write_back`` picks
                             write-through ("on_put") or demotion ("on_evict") to disk.
    promote_on_get:         a full ``get`` served from disk also enters host memory.
    promote_on_get_layers:  a sparse disk hit queues a background promotion (a full
                             read of the record) so the next request hits in host memory.
    promotion_queue:        pending background promotions; more are dropped.
    """

    host: HostStoreConfig
    disk: DiskStoreConfig
    promote_on_get: bool = True
    promote_on_get_layers: bool = True
    promotion_queue: int = 16

    def __post_init__(self) -> None:
        if self.promotion_queue < 1:
            raise ValueError(f"promotion_queue must be >= 1, got {self.promotion_queue}")


@register_store
class TieredStore(ChunkStore):
    """Lookups try host memory, then disk; a disk hit is promoted to host memory. New
    records enter host memory and reach disk through the host's write-back thread.
    Stats are the host's and the disk's, summed (``tier_stats`` gives them apart)."""

    name: ClassVar[str] = "tiered"

    def __init__(
        self,
        config: TieredStoreConfig,
        model_digest: str,
        device: DeviceTier | None = None,
    ) -> None:
        self.config = config
        self.model_digest = check_key(model_digest)
        self.device = device
        self.disk = DiskStore(config.disk, model_digest)
        self.host = HostStore(config.host, model_digest, write_back_to=self.disk.put)
        self._promoter = WriteBack(WriteBackConfig(config.promotion_queue), "sgl-pic-promote")
        self._promoting: set[str] = set()
        self._lock = threading.Lock()

    def locate(self, key: str) -> Tier | None:
        """The fastest tier holding ``key`` now, or None. Changes nothing."""
        if self.device is not None and self.device.contains(key):
            return "device"
        if self.host.contains(key):
            return "host"
        if self.disk.contains(key):
            return "disk"
        return None

    def contains(self, key: str) -> bool:
        return self.host.contains(key) or self.disk.contains(key)

    def peek_ranking(self, key: str, token_ids: Sequence[int] | None = None) -> RankingPeek | None:
        """The record's ranking without moving its KV (from host memory, else from the
        file header), or None if the key is not held or the header is unusable. Counts
        nothing; a bad file is left for the next read to detect, count and drop."""
        if self.host.contains(key):
            record = self.host.peek(key)
            if record is not None:
                if token_ids is not None and tuple(int(t) for t in token_ids) != record.token_ids:
                    return None
                return RankingPeek(record.ranking)
        if self.disk.contains(key):
            header = self.disk.peek_header(key, token_ids)
            if header is not None:
                return RankingPeek(header.ranking)
        return None

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        if self.host.contains(key):
            record = self.host.get(key, token_ids)
            if record is not None:
                return record
        record = self.disk.get(key, token_ids)
        if record is not None and self.config.promote_on_get:
            # Already on disk: no write-back of the promoted copy.
            self.host.insert(record, write_back=False)
        return record

    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        if self.host.contains(key):
            part = self.host.get_layers(key, layers, token_indices, token_ids)
            if part is not None:
                return part
        part = self.disk.get_layers(key, layers, token_indices, token_ids)
        if part is not None and self.config.promote_on_get_layers:
            self._queue_promotion(key, token_ids)
        return part

    def _queue_promotion(self, key: str, token_ids: Sequence[int] | None) -> None:
        with self._lock:
            if key in self._promoting:
                return
            self._promoting.add(key)

        def promote() -> None:
            try:
                if not self.host.contains(key):
                    record = self.disk.get(key, token_ids)
                    if record is not None:
                        self.host.insert(record, write_back=False)
            finally:
                with self._lock:
                    self._promoting.discard(key)

        if not self._promoter.submit(promote):
            with self._lock:
                self._promoting.discard(key)

    def put(self, record: ChunkKV) -> bool:
        """Held in host memory (write-back to disk follows), or, when host memory cannot
        take it, written to disk directly."""
        return self.host.put(record) or self.disk.put(record)

    def evict(self, nbytes: int) -> EvictResult:
        """Evicts from host memory only (evicted records demote to disk per
        ``host.write_back``); use ``disk.evict`` to free disk space."""
        return self.host.evict(nbytes)

    def lock(self, key: str) -> bool:
        """Locks the key in every tier holding it; True if any did."""
        in_host = self.host.lock(key)
        in_disk = self.disk.lock(key)
        return in_host or in_disk

    def unlock(self, key: str) -> None:
        self.host.unlock(key)
        self.disk.unlock(key)

    def stats(self) -> StoreStats:
        h, d = self.host.stats(), self.disk.stats()
        errors = dict(d.errors)
        for kind, n in h.errors.items():
            errors[kind] = errors.get(kind, 0) + n
        return StoreStats(
            entries=h.entries + d.entries,
            bytes_used=h.bytes_used + d.bytes_used,
            capacity_bytes=h.capacity_bytes + d.capacity_bytes,
            # A host miss that hits on disk is one hit, not a miss and a hit.
            hits=h.hits + d.hits,
            misses=d.misses,
            puts=h.puts + d.puts,
            rejected_puts=h.rejected_puts + d.rejected_puts,
            evictions=h.evictions + d.evictions,
            evicted_bytes=h.evicted_bytes + d.evicted_bytes,
            bytes_read=h.bytes_read + d.bytes_read,
            errors=MappingProxyType(errors),
        )

    def tier_stats(self) -> dict[str, StoreStats]:
        return {"host": self.host.stats(), "disk": self.disk.stats()}

    def flush(self) -> None:
        """Wait for pending promotions, then for pending write-backs to disk."""
        self._promoter.flush()
        self.host.flush()

    def close(self) -> None:
        self._promoter.close()
        self.host.close()
