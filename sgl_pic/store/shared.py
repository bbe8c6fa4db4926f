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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import ClassVar

import numpy as np
import torch

from sgl_pic.store.base import (
    ChunkKV,
    ChunkStore,
    EvictResult,
    LayerKV,
    RecordLayout,
    StoreStats,
    check_key,
    hash_token_ids,
    layer_offsets,
    normalize_indices,
    register_store,
)
from sgl_pic.store.deletion import DeleteReport, Deletion
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.errors import (
    CorruptRecordError,
    ForeignModelError,
    LayoutMismatchError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from sgl_pic.store.host import WriteBack, WriteBackConfig, WriteBackStats
from sgl_pic.store.object_backend import (
    BackendError,
    BackendUnavailable,
    ObjectBackend,
    PutOutcome,
    StoreAddress,
    make_backend,
)
from sgl_pic.store.record_encode import encode_record
from sgl_pic.store.record_header import (
    PREFIX_BYTES,
    RecordHeader,
    check_expectations,
    parse_header,
)
from sgl_pic.store.shared_backfill import Backfill
from sgl_pic.store.shared_deletion import Known, SharedDeletions
from sgl_pic.store.shared_read import read_blocks
from sgl_pic.store.store_link import LinkConfig, LinkStats, StoreLink

logger = logging.getLogger(__name__)

# First read of an object: the prefix and, for records of usual size, the whole header.
_HEAD_READ = 64 << 10


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
    executor answers by recomputing the chunk."""

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
        self._writer = WriteBack(WriteBackConfig(config.write_queue), "sgl-pic-shared-write")
        self._pending: set[str] = set()
        self._headers: OrderedDict[str, RecordHeader] = OrderedDict()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._on_write: Callable[[], None] | None = None
        self.deletions = SharedDeletions(
            self.link, config.tombstones_kept, config.header_cache, self._known, self._forget
        )
        self.backfill = Backfill(
            config.backfill_keys,
            self.model_digest,
            config.block_tokens,
            self.link,
            self.deletions,
            self._writer.submit,
            self._count,
            self._notify_write,
        )
        self.link.on_recover(self.backfill.on_recover)

    # ------------------------------------------------------------------ reads
    def contains(self, key: str) -> bool:
        with self._lock:
            header = self._headers.get(key)
        if header is not None:
            if not self.deletions.covers(header):
                return True
            self._forget(key)  # deleted since it was read; the store may hold a newer one
        try:
            return self.link.call(lambda b: b.exists([key])[0])
        except (BackendUnavailable, BackendError):
            return False

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _bad(self, key: str, exc: StoreError | BackendError) -> None:
        """Count a bad object; remove it unless it is another model's (never ours to drop)."""
        kind = {
            CorruptRecordError: "corrupt",
            TruncatedRecordError: "truncated",
            ForeignModelError: "foreign_model",
            LayoutMismatchError: "layout_mismatch",
            TokenMismatchError: "token_mismatch",
            UnsupportedFormatError: "newer_format",
            BackendError: "truncated",
        }.get(type(exc), "corrupt")
        with self._lock:
            self._errors[kind] += 1
            self._headers.pop(key, None)
        logger.warning("sgl_pic: shared record %s is bad (%s): %s", key[:12], kind, exc)
        if kind in ("foreign_model", "newer_format"):
            return
        with contextlib.suppress(BackendUnavailable, BackendError):
            self.link.call(lambda b: b.remove(key))

    def _header(self, key: str, token_ids: Sequence[int] | None) -> RecordHeader | None:
        """The key's checked header (cached), or None on a miss, a bad object (counted) or
        a record a deletion tombstone covers (counted "tombstoned", removed). Raises
        BackendUnavailable."""
        for attempt in range(2):
            with self._lock:
                header = self._headers.get(key)
                if header is not None:
                    self._headers.move_to_end(key)
            cached = header is not None
            if header is None:
                header = self._fetch_header(key)
                if header is None:
                    return None
            try:
                check_expectations(header, self.model_digest, key, token_ids)
                if self.layout is not None:
                    self.layout.check_header(header)
            except StoreError as exc:  # other tokens, another key, or another KV layout
                self._bad(key, exc)
                return None
            if not self.deletions.covers(header):
                return header
            self._forget(key)
            if cached and not attempt:
                continue  # cached before the tombstone: the object may be a newer one now
            # Written before a deletion that covers it: a miss, and the object goes.
            self._count("tombstoned")
            with contextlib.suppress(BackendUnavailable, BackendError):
                self.link.call(lambda b: b.remove(key))
            return None
        return None

    def _fetch_header(self, key: str) -> RecordHeader | None:
        """The header read from the store and cached; None on a miss or a bad object."""
        size = self.link.call(lambda b: b.size(key))
        if size is None:
            return None
        head = self.link.call(lambda b: b.read_ranges(key, [(0, min(size, _HEAD_READ))]))
        if head is None:
            return None
        try:
            header = self._parse(key, head.tobytes(), size)
        except (StoreError, BackendError) as exc:
            self._bad(key, exc)
            return None
        with self._lock:
            self._headers[key] = header
            while len(self._headers) > self.config.header_cache:
                self._headers.popitem(last=False)
        return header

    def _parse(self, key: str, head: bytes, size: int) -> RecordHeader:
        def body(n: int) -> bytes:
            if PREFIX_BYTES + n <= len(head):
                return head[PREFIX_BYTES : PREFIX_BYTES + n]
            more = self.link.call(lambda b: b.read_ranges(key, [(PREFIX_BYTES, n)]))
            if more is None:
                raise TruncatedRecordError("object vanished while its header was read")
            return more.tobytes()

        return parse_header(head[:PREFIX_BYTES], body, size, self.model_digest)

    def peek_ranking(
        self, key: str, token_ids: Sequence[int] | None = None
    ) -> torch.Tensor | None | bool:
        """# [num_tokens] the record's ranking, None if it has none, or False when the key
        is not usable here (missing, bad, unreachable). Counts no hit or miss."""
        try:
            header = self._header(key, token_ids)
        except (BackendUnavailable, BackendError):
            return False
        return False if header is None else header.ranking

    def _read(
        self,
        key: str,
        header: RecordHeader,
        offsets: range,
        idx: np.ndarray,  # [n] int64 sorted unique token indices
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(k, v # [len(offsets), n, heads, head_dim], bytes moved) of the tokens ``idx``
        of record layers ``offsets``, every touched block verified; None on a miss."""
        return read_blocks(self.link, key, header, offsets, idx)

    def _read_checked(
        self,
        key: str,
        token_ids: Sequence[int] | None,
        read: Callable[[RecordHeader], tuple[torch.Tensor, torch.Tensor, int] | None],
    ) -> tuple[RecordHeader | None, tuple[torch.Tensor, torch.Tensor, int] | None]:
        """(header, ``read(header)``), or (None, None) on a miss. A payload that fails its
        checks against a cached header is read again once with a fresh header before it
        counts as bad: the store may have evicted the object and another server stored the
        key anew (recomputed KV need not be the same bytes). Raises what ``read`` raises."""
        for attempt in range(2):
            with self._lock:
                cached = key in self._headers
            header = self._header(key, token_ids)
            if header is None:
                return None, None
            try:
                return header, read(header)
            except (CorruptRecordError, TruncatedRecordError, BackendError):
                if attempt or not cached:
                    raise
                self._forget(key)
        raise AssertionError("unreachable")

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        try:
            header, res = self._read_checked(
                key,
                token_ids,
                lambda h: self._read(
                    key, h, range(h.num_layers), np.arange(h.num_tokens, dtype=np.int64)
                ),
            )
            if header is None:
                self._count("misses")
                return None
        except (BackendUnavailable, BackendError) as exc:
            if isinstance(exc, BackendError):
                self._bad(key, exc)
            self._count("misses")
            return None
        except StoreError as exc:
            self._bad(key, exc)
            self._count("misses")
            return None
        if res is None:
            self._forget(key)
            self._count("misses")
            return None
        k, v, nbytes = res
        self._count("hits")
        self._count("bytes_read", nbytes)
        return ChunkKV(
            key=key,
            model_digest=header.model_digest,
            token_ids=header.token_ids,
            k=k,
            v=v,
            ranking=header.ranking,
            layer_start=header.layer_start,
            namespace=header.namespace,
        )

    def _forget(self, key: str) -> None:
        with self._lock:
            self._headers.pop(key, None)

    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        def read(h: RecordHeader) -> tuple[torch.Tensor, torch.Tensor, int] | None:
            held = range(h.layer_start, h.layer_start + h.num_layers)
            offsets = layer_offsets(held, layers)  # RecordShapeError: the caller's mistake
            idx = normalize_indices(token_indices, h.num_tokens)
            return self._read(key, h, offsets, idx.numpy())

        try:
            header, res = self._read_checked(key, token_ids, read)
            if header is None:
                self._count("misses")
                return None
        except (BackendUnavailable, BackendError) as exc:
            if isinstance(exc, BackendError):
                self._bad(key, exc)
            self._count("misses")
            return None
        except (CorruptRecordError, TruncatedRecordError) as exc:
            self._bad(key, exc)
            self._count("misses")
            return None
        if res is None:
            self._forget(key)
            self._count("misses")
            return None
        k, v, nbytes = res
        self._count("hits")
        self._count("bytes_read", nbytes)
        idx = normalize_indices(token_indices, header.num_tokens)
        moved = 2 * len(layers) * idx.numel() * header.row_bytes  # as the other tiers count
        return LayerKV(key, layers, idx, k, v, bytes_read=moved)

    # ----------------------------------------------------------------- writes
    def put(self, record: ChunkKV) -> bool:
        """Queues the write and returns True, or False (counted) when the record is of
        another model, the store is down, or the queue is full. The write itself is
        set-if-absent: a record another server stored first is left as it is."""
        if record.model_digest != self.model_digest:
            with self._lock:
                self._errors["foreign_model"] += 1
            return False
        if self.layout is not None:
            try:
                self.layout.check_record(record)
            except LayoutMismatchError:
                with self._lock:
                    self._errors["layout_mismatch"] += 1
                return False
        if not self.link.stats().up:
            self._count("writes_skipped")
            self.backfill.remember(record.key)
            return False
        # Taken now, in the caller's order with the deletions it applies: the write is
        # dropped if a deletion made after now matches, and its header tells readers
        # which tombstones it predates.
        since, seen = self.deletions.marks()
        with self._lock:
            if record.key in self._pending or record.key in self._headers:
                return True
            self._pending.add(record.key)
        # The writer reads the record later, on its own thread: it gets a host copy made
        # now, in the caller's stream order, since the caller may reuse its buffers (on an
        # accelerator, still being filled by queued kernels) once ``put`` returns.
        try:
            record = replace(
                record,
                k=record.k.to("cpu", copy=True),
                v=record.v.to("cpu", copy=True),
                ranking=None if record.ranking is None else record.ranking.to("cpu", copy=True),
            )
        except BaseException:
            with self._lock:
                self._pending.discard(record.key)
            raise

        def write() -> None:
            try:
                content = hash_token_ids(record.token_ids)
                if self.deletions.dropped(since, record.namespace, content):
                    self._count("deleted_in_flight")
                    return
                enc = encode_record(record, self.config.block_tokens, seen)
                outcome = self.link.call(
                    lambda b: b.put_if_absent(record.key, [enc.head, *enc.areas]),
                    background=True,
                )
                self._count("stored" if outcome is PutOutcome.STORED else "present")
                if outcome is PutOutcome.STORED:
                    self.deletions.wrote(record.key, record.namespace, content, record.nbytes)
            except BackendUnavailable:
                self._count("write_failed")
                self.backfill.remember(record.key)
                raise
            except BackendError:
                self._count("write_failed")
                raise
            finally:
                with self._lock:
                    self._pending.discard(record.key)
                self._notify_write()

        if not self._writer.submit(write):
            with self._lock:
                self._pending.discard(record.key)
            return False
        return True

    def set_backfill_source(self, source: Callable[[str], ChunkKV | None]) -> None:
        """Where the backfill after an outage reads a remembered key's record from (this
        server's own tiers; None when they no longer hold it). Called from the writer
        thread; it must not raise."""
        self.backfill.set_source(source)

    def _notify_write(self) -> None:
        with self._lock:
            listener = self._on_write
        if listener is not None:
            listener()

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

    def _known(self) -> dict[str, Known]:
        with self._lock:
            return {
                k: (h.namespace, h.token_ids_hash, h.payload_bytes)
                for k, h in self._headers.items()
            }

    def evict(self, nbytes: int) -> EvictResult:
        return EvictResult((), 0)

    def lock(self, key: str) -> bool:
        return self.contains(key)

    def unlock(self, key: str) -> None:
        return None

    # ------------------------------------------------------------ bookkeeping
    def stats(self) -> StoreStats:
        with self._lock:
            c = Counter(self._counts)
            errors = dict(self._errors)
            entries = len(self._headers)
        return StoreStats(
            entries=entries,
            bytes_used=0,
            capacity_bytes=0,
            hits=c["hits"],
            misses=c["misses"],
            puts=c["stored"] + c["present"],
            rejected_puts=c["write_failed"] + c["writes_skipped"],
            bytes_read=c["bytes_read"],
            errors=MappingProxyType(errors),
        )

    def write_counts(self) -> dict[str, int]:
        """Finished writes by outcome: "stored" (this server wrote it), "present"
        (another server had), "failed" (store error), "skipped" (store down); and
        "backfilled": of the stored ones, those written after an outage for writes it
        skipped."""
        with self._lock:
            c = self._counts
            return {
                "stored": c["stored"],
                "present": c["present"],
                "failed": c["write_failed"],
                "skipped": c["writes_skipped"],
                "backfilled": c["backfilled"],
            }

    def on_write(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` on the writer thread after each write finishes (counts are
        then current), so exported counters need not wait for the next batch. It must
        not raise."""
        with self._lock:
            self._on_write = listener

    def link_stats(self) -> LinkStats:
        return self.link.stats()

    def writer_stats(self) -> WriteBackStats:
        return self._writer.stats()

    def flush(self) -> None:
        """Wait for every queued write."""
        self._writer.flush()

    def shutdown(self, timeout_s: float) -> int:
        """Run queued writes until ``timeout_s``, drop the rest, leave the store; returns
        how many were dropped."""
        result = self._writer.shutdown(timeout_s)
        self.link.close()
        return result.cancelled

    def close(self) -> None:
        self._writer.close()
        self.link.close()
