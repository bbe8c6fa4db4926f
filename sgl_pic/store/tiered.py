"""Host + disk (+ an optional shared tier below them) as one store: demotion of evicted
host records to disk, write-back of new records, and promotion of disk and shared hits
into host memory.

The shared tier (``sgl_pic.store.shared.store``, a store several servers use) is the last one
looked up; new records are written to it asynchronously as well as to host memory, so a
chunk one server computed is a hit on the others.

Deletion (``delete``) reaches every tier at once; the tiers share one ``DeletionLog``, so
work queued before a deletion (write-back to disk, promotions, shared writes, backfill)
drops what it matches when it runs instead of bringing it back.

Background promotion is ``tier_promotion``, the bounded stop at exit ``tier_shutdown``,
the summed stats ``tier_stats``.

The device (GPU) tier belongs to the SGLang integration: it demotes by calling ``put``
with a record copied to the host, and may report residency through ``DeviceTier`` so
``locate`` can say where a chunk lives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Protocol

import torch

from sgl_pic.store.base import (
    ChunkKV,
    ChunkStore,
    EvictResult,
    LayerKV,
    RecordLayout,
    StoreStats,
    check_key,
    register_store,
)
from sgl_pic.store.deletion import DeleteReport, Deletion
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.host import (
    HostStore,
    HostStoreConfig,
    WriteBack,
    WriteBackConfig,
    WriteBackStats,
)
from sgl_pic.store.record.write import WriteCancelled
from sgl_pic.store.shared.store import SharedStore
from sgl_pic.store.tier_promotion import Promotions
from sgl_pic.store.tier_shutdown import ShutdownReport as ShutdownReport
from sgl_pic.store.tier_shutdown import shutdown_tiers
from sgl_pic.store.tier_stats import sum_tier_stats

Tier = Literal["device", "host", "disk", "shared"]


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
    """Lookups try host memory, then disk, then the shared tier if there is one; a disk
    or shared hit is promoted to host memory. New records enter host memory and reach
    disk through the host's write-back thread, and the shared tier through its own.
    Stats are the tiers', summed (``tier_stats`` gives them apart)."""

    name: ClassVar[str] = "tiered"

    def __init__(
        self,
        config: TieredStoreConfig,
        model_digest: str,
        device: DeviceTier | None = None,
        shared: SharedStore | None = None,
        layout: RecordLayout | None = None,
    ) -> None:
        """shared: the shared tier, built for the same ``model_digest`` and ``layout``;
        owned (closed and shut down) by this store from now on.
        layout: the KV layout of the pool the records are loaded into; every tier treats
        a record of another as bad (counted "layout_mismatch", dropped, a miss)."""
        self.config = config
        self.model_digest = check_key(model_digest)
        self.layout = layout
        if shared is not None and shared.model_digest != self.model_digest:
            raise ValueError("the shared tier was built for another model fingerprint")
        if shared is not None and shared.layout != layout:
            raise ValueError("the shared tier was built for another record layout")
        self.device = device
        self.shared = shared
        # One log for every tier: a job queued against one tier checks deletions made
        # through any of them.
        self.deletions = DeletionLog()
        self.disk = DiskStore(config.disk, model_digest, layout, self.deletions)
        self.host = HostStore(
            config.host,
            model_digest,
            layout=layout,
            write_back_since_to=self.disk.put,
            deletions=self.deletions,
        )
        if shared is not None:
            shared.set_backfill_source(self._local_record)
            shared.set_deletions(self.deletions)
        self._promoter = WriteBack(WriteBackConfig(config.promotion_queue), "sgl-pic-promote")
        self._promotions = Promotions(self._promoter, self.host, self.disk, shared, self.deletions)

    def _local_record(self, key: str) -> ChunkKV | None:
        """The record from host memory or disk, counting no access (the shared tier's
        backfill after an outage)."""
        return self.host.peek(key) or self.disk.peek(key)

    def locate(self, key: str) -> Tier | None:
        """The fastest tier holding ``key`` now, or None. Changes nothing."""
        if self.device is not None and self.device.contains(key):
            return "device"
        if self.host.contains(key):
            return "host"
        if self.disk.contains(key):
            return "disk"
        if self.shared is not None and self.shared.contains(key):
            return "shared"
        return None

    def contains(self, key: str) -> bool:
        """Held in host memory or on disk (the shared tier is not asked: a network call,
        and its writes de-duplicate themselves)."""
        return self.host.contains(key) or self.disk.contains(key)

    def peek_ranking(self, key: str, token_ids: Sequence[int] | None = None) -> RankingPeek | None:
        """The record's ranking without moving its KV (from host memory, else from the
        file header), or None if the key is not held or the header is unusable. Counts
        no access; a file whose header fails its checks is counted and dropped
        (``DiskStore.peek_header``), so ``contains`` turns False and the next ``put``
        stores the chunk afresh."""
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
        if self.shared is not None:
            ranking = self.shared.peek_ranking(key, token_ids)
            if ranking is not False:
                return RankingPeek(ranking)  # type: ignore[arg-type]  # a tensor or None
        return None

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        since = self.deletions.seq
        if self.host.contains(key):
            record = self.host.get(key, token_ids)
            if record is not None:
                return record
        record = self.disk.get(key, token_ids)
        if record is None and self.shared is not None:
            record = self.shared.get(key, token_ids)
        if record is not None and self.config.promote_on_get:
            # Already on disk or shared: no write-back of the promoted copy.
            self.host.insert(record, write_back=False, since=since)
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
        if part is None and self.shared is not None:
            part = self.shared.get_layers(key, layers, token_indices, token_ids)
        if part is not None and self.config.promote_on_get_layers:
            self._promotions.queue(key, token_ids)
        return part

    def put(self, record: ChunkKV) -> bool:
        """Held in host memory (write-back to disk follows), or, when host memory cannot
        take it, written to disk directly. Also queued for the shared tier (never
        waited for); True when a local tier keeps it or the shared write was queued."""
        shared = self.shared is not None and self.shared.put(record)
        if self.host.put(record):
            return True
        try:
            return self.disk.put(record) or shared
        except WriteCancelled:
            # ``shutdown`` stopped this direct write mid-way; it left no file.
            return shared

    def delete(self, d: Deletion) -> dict[str, DeleteReport]:
        """Remove what ``d`` matches from every tier ("host", "disk", and "shared" with a
        shared tier, which also appends a tombstone for the other servers); work queued
        before now drops what ``d`` matches when it runs. Called from the scheduler
        thread; safe while the background writers run."""
        self.deletions.append(d)  # first: an insert racing the removal sees it
        out = {"host": self.host.remove_matching(d), "disk": self.disk.remove_matching(d)}
        if self.shared is not None:
            out["shared"] = self.shared.delete(d, logged=True)
        return out

    def sync_deletions(self) -> tuple[Deletion, ...]:
        """Deletions other servers appended to the shared store's tombstone log since the
        last call (one small backend read when there are none; none while the store is
        unreachable), applied to the host and disk tiers as ``delete`` applies them, and
        returned for the scheduler to apply to its device chunk nodes. () without a
        shared tier. Called from the scheduler thread before each lookup batch."""
        if self.shared is None:
            return ()
        return self.shared.sync_deletions(self._remove_local)

    def _remove_local(self, d: Deletion) -> None:
        # The shared tier logged ``d`` in ``deletions`` (the same log) already.
        self.host.remove_matching(d)
        self.disk.remove_matching(d)

    def evict(self, nbytes: int) -> EvictResult:
        """Evicts from host memory only (evicted records demote to disk per
        ``host.write_back``); use ``disk.evict`` to free disk space."""
        return self.host.evict(nbytes)

    def lock(self, key: str) -> bool:
        """Locks the key in every tier holding it; True if any did."""
        in_host = self.host.lock(key)
        in_disk = self.disk.lock(key)
        if in_host or in_disk:
            return True
        return self.shared is not None and self.shared.lock(key)

    def unlock(self, key: str) -> None:
        self.host.unlock(key)
        self.disk.unlock(key)

    def stats(self) -> StoreStats:
        """Summed over the tiers. Errors of the shared tier are reported as
        ``shared_<kind>`` (e.g. ``shared_corrupt``), apart from the local tiers'."""
        shared = self.shared.stats() if self.shared is not None else None
        return sum_tier_stats(self.host.stats(), self.disk.stats(), shared)

    def tier_stats(self) -> dict[str, StoreStats]:
        out = {"host": self.host.stats(), "disk": self.disk.stats()}
        if self.shared is not None:
            out["shared"] = self.shared.stats()
        return out

    def flush(self) -> None:
        """Wait for pending promotions, then for pending write-backs to disk and to the
        shared tier."""
        self._promoter.flush()
        self.host.flush()
        if self.shared is not None:
            self.shared.flush()

    def close(self) -> None:
        """Run every queued promotion and write-back, then stop the threads."""
        self._promoter.close()
        self.host.close()
        if self.shared is not None:
            self.shared.close()

    def queue_stats(self) -> dict[str, WriteBackStats]:
        """Cumulative counts of the background queues: "writeback" (host -> disk, absent
        without one) and "tier_promotion" (disk -> host)."""
        out = {"tier_promotion": self._promoter.stats()}
        wb = self.host.write_back_stats()
        if wb is not None:
            out["writeback"] = wb
        if self.shared is not None:
            out["shared_write"] = self.shared.writer_stats()
        return out

    def shutdown(
        self, timeout_s: float, stop: threading.Event | None = None, join_s: float = 2.0
    ) -> ShutdownReport:
        """Bounded stop for process exit. Queued promotions are skipped (a dying process
        gains nothing from them; one already running may finish). Queued write-backs run
        until ``timeout_s`` from now, or until ``stop`` is set; the rest are dropped,
        and a write still running then is stopped before its rename. Afterwards the disk
        takes no more writes (``DiskStore.abort_writes``), so every file on disk is
        complete and checksum-valid and no temp file of ours remains, unless a write was
        stuck inside one system call past ``join_s`` (reported as not joined; start-up
        removes such a temp file). Reads keep working. Idempotent."""
        return shutdown_tiers(
            self._promoter, self.host, self.disk, self.shared, timeout_s, stop, join_s
        )
