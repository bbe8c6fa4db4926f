"""The shared tier: chunk records in a distributed object store that several servers use.

A record is stored as one object under its segment key, in the disk tier's file layout
(``format``: checksummed msgpack header, raw per-layer K/V with per-block SHA-256), keys
before RoPE as in the host tier. Keys are content hashes over the tokens and the model
fingerprint, so a chunk one server computed is found by every server of the same model and
settings, and never by another. Reads are sparse: a layer read moves only the checksum
blocks holding the wanted tokens, verified before any byte is returned. Headers are read
once per key and kept (a key names one content, so a verified header never goes stale;
the payload checks still catch an object replaced by bad bytes).

Writes are asynchronous (a bounded queue, one thread; what it refuses is counted),
de-duplicated within the process (a key already queued is not queued again) and across
servers (set-if-absent in the store: the first writer wins). A bad object (corrupt,
truncated) is counted, removed from the store, and answered as a miss, so the chunk is
recomputed and stored afresh; a record of another model is counted and left alone.
When the store is unreachable every call answers a miss or False at once (``StoreLink``);
the keys of the writes skipped then are remembered (up to ``backfill_keys``), and when the
store is back one background job writes those the server still holds (``set_backfill_source``),
so an outage does not leave the chunks computed during it out of the shared tier for good.

Deletion: ``delete`` appends a tombstone to the log in the store (``tombstones``) and
removes the matching keys this server knows (headers it read, records it wrote). Every
record written carries the count of tombstones its writer had applied; a read of a record
a later tombstone covers is a miss, and the object is removed. ``sync_deletions`` reads
the tombstones other servers appended, for the tiers above to apply.

Where each part lives: reads ``shared.reader`` (block reads ``shared.blocks``, kept
headers ``shared.headers``), writes ``shared.writer`` (backfill ``shared.backfill``),
deletions ``shared.deletion`` (tombstones ``tombstones``), the link ``store_link``, the
counters ``shared.counts``; ``SharedStore`` puts them together behind ``ChunkStore``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

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
from sgl_pic.store.host import WriteBackStats
from sgl_pic.store.object_backend import (
    ObjectBackend,
    StoreAddress,
    make_backend,
)
from sgl_pic.store.shared.counts import SharedCounts
from sgl_pic.store.shared.deletion import SharedDeletions
from sgl_pic.store.shared.headers import HeaderCache
from sgl_pic.store.shared.reader import SharedReader
from sgl_pic.store.shared.writer import SharedWriter
from sgl_pic.store.store_link import LinkConfig, LinkStats, StoreLink


@dataclass(frozen=True)
class SharedStoreConfig:
    """url:           the store, e.g. ``mooncake://127.0.0.1:50551`` (``object_backend``).
    link:            call timeout and retry period (``StoreLink``).
    write_queue:     asynchronous writes pending (each holds its record's tensors until
                     written); more are dropped (counted).
    header_cache:    parsed headers kept, most recently used first out last.
    block_tokens:    tokens per checksum block of records this server writes.
    backfill_keys:   keys of writes skipped while the store was down, remembered for
                     when it is back (the oldest forgotten first).
    tombstones_kept: deletion tombstones kept in memory; a record older than all of them
                     reads as deleted once more were made (``tombstones``).
    """

    url: str
    link: LinkConfig = field(default_factory=LinkConfig)
    write_queue: int = 16
    header_cache: int = 4096
    block_tokens: int = 32
    backfill_keys: int = 4096
    tombstones_kept: int = 65536

    def __post_init__(self) -> None:
        StoreAddress.parse(self.url)
        sizes = (self.write_queue, self.header_cache, self.block_tokens, self.backfill_keys)
        if min(*sizes, self.tombstones_kept) < 1:
            raise ValueError(
                "write_queue, header_cache, block_tokens, backfill_keys and "
                "tombstones_kept must be >= 1"
            )


@register_store
class SharedStore(ChunkStore):
    """See the module docstring. ``capacity_bytes`` and eviction belong to the store's own
    process (Mooncake evicts by its watermark); ``evict`` here frees nothing and ``lock``
    pins nothing: a record evicted under a reader makes that read a miss, which the
    executor answers by recomputing the chunk.

    Composed of the link to the store (``link``), the kept headers (``headers``), the
    reads (``reader``), the writes with the backfill (``writer``) and the deletions
    (``deletions``), which share the counters (``counts``)."""

    name: ClassVar[str] = "shared"

    def __init__(
        self,
        config: SharedStoreConfig,
        model_digest: str,
        backend: ObjectBackend | None = None,
        layout: RecordLayout | None = None,
    ) -> None:
        """layout: the KV layout (the serving pool's) every object must have; one of
        another is bad (error kind "layout_mismatch", removed). None checks none."""
        self.config = config
        self.model_digest = check_key(model_digest)
        self.layout = layout
        self.link = StoreLink(backend or make_backend(config.url), config.link, config.url)
        self.counts = SharedCounts()
        self.headers = HeaderCache(config.header_cache)
        self.deletions = SharedDeletions(
            self.link,
            config.tombstones_kept,
            config.header_cache,
            self.headers.known,
            self.headers.forget,
        )
        self.reader = SharedReader(
            self.link, self.headers, self.deletions, self.counts, self.model_digest, layout
        )
        self.writer = SharedWriter(
            self.link,
            self.headers,
            self.deletions,
            self.counts,
            self.model_digest,
            layout,
            config.write_queue,
            config.block_tokens,
            config.backfill_keys,
        )
        self.backfill = self.writer.backfill
        self.link.on_recover(self.backfill.on_recover)

    # ------------------------------------------------------------------ reads
    def contains(self, key: str) -> bool:
        return self.reader.contains(key)

    def peek_ranking(
        self, key: str, token_ids: Sequence[int] | None = None
    ) -> torch.Tensor | None | bool:
        """# [num_tokens] the record's ranking, None if it has none, or False when the key
        is not usable here (missing, bad, unreachable). Counts no hit or miss."""
        return self.reader.peek_ranking(key, token_ids)

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        return self.reader.get(key, token_ids)

    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        return self.reader.get_layers(key, layers, token_indices, token_ids)

    # ----------------------------------------------------------------- writes
    def put(self, record: ChunkKV) -> bool:
        """Queues the write and returns True, or False (counted) when the record is of
        another model, the store is down, or the queue is full. The write itself is
        set-if-absent: a record another server stored first is left as it is."""
        return self.writer.put(record)

    def set_backfill_source(self, source: Callable[[str], ChunkKV | None]) -> None:
        """Where the backfill after an outage reads a remembered key's record from (this
        server's own tiers; None when they no longer hold it). Called from the writer
        thread; it must not raise."""
        self.backfill.set_source(source)

    # --------------------------------------------------------------- deletion
    def set_deletions(self, log: DeletionLog) -> None:
        """Share the tiers' deletion log (``TieredStore``): a write queued before a
        deletion made through any tier is dropped when it runs. Call before any put."""
        self.deletions.log = log

    def delete(self, d: Deletion, logged: bool = False) -> DeleteReport:
        """Append a tombstone for ``d`` (so every server sharing the store stops serving
        what it matches and was written before), then remove the matching keys this
        server knows (headers it read, records it wrote); reports those. While the store
        is unreachable the tombstone waits (``unsent_deletions``, retried by
        ``sync_deletions``) and this server's own reads already honour it. ``logged``:
        the caller appended ``d`` to the shared deletion log already. Called from the
        scheduler thread, after the tiers above removed their copies."""
        return self.deletions.delete(d, logged)

    def sync_deletions(
        self, apply: Callable[[Deletion], object] | None = None
    ) -> tuple[Deletion, ...]:
        """Send the tombstones waiting for the store, read those other servers appended
        since the last call (one small read when none is new; none while the store is
        down), log each, remove the matching keys known here, pass each to ``apply``
        (the tiers above remove their copies), and only then count them as applied in
        the headers of later writes. Returns them. Called from the scheduler thread."""
        return self.deletions.sync(apply)

    def unsent_deletions(self) -> int:
        """Deletions whose tombstone is not in the store yet (it was unreachable)."""
        return self.deletions.unsent()

    def evict(self, nbytes: int) -> EvictResult:
        return EvictResult((), 0)

    def lock(self, key: str) -> bool:
        return self.contains(key)

    def unlock(self, key: str) -> None:
        return None

    # ------------------------------------------------------------ bookkeeping
    def stats(self) -> StoreStats:
        return self.counts.store_stats(len(self.headers))

    def write_counts(self) -> dict[str, int]:
        """Finished writes by outcome: "stored" (this server wrote it), "present"
        (another server had), "failed" (store error), "skipped" (store down); and
        "backfilled": of the stored ones, those written after an outage for writes it
        skipped."""
        return self.counts.write_counts()

    def on_write(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` on the writer thread after each write finishes (counts are
        then current), so exported counters need not wait for the next batch. It must
        not raise."""
        self.writer.on_write(listener)

    def link_stats(self) -> LinkStats:
        return self.link.stats()

    def writer_stats(self) -> WriteBackStats:
        return self.writer.queue.stats()

    def flush(self) -> None:
        """Wait for every queued write."""
        self.writer.queue.flush()

    def shutdown(self, timeout_s: float) -> int:
        """Run queued writes until ``timeout_s``, drop the rest, leave the store; returns
        how many were dropped."""
        result = self.writer.queue.shutdown(timeout_s)
        self.link.close()
        return result.cancelled

    def close(self) -> None:
        self.writer.queue.close()
        self.link.close()
