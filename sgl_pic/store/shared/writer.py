"""Writes of the shared tier: asynchronous (a bounded queue, one thread; what it refuses
is counted), de-duplicated within the process (a key already queued or known is not
queued again) and across servers (set-if-absent in the store: the first writer wins).
A write that a deletion made after ``put`` matches is dropped when it runs. While the
store is unreachable writes are skipped and their keys remembered for the ``Backfill``
that runs once it is back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from sgl_pic.store.base import ChunkKV, RecordLayout
from sgl_pic.store.errors import LayoutMismatchError
from sgl_pic.store.host import WriteBack, WriteBackConfig
from sgl_pic.store.object_backend import BackendError, BackendUnavailable, PutOutcome
from sgl_pic.store.record.encode import encode_record
from sgl_pic.store.shared.backfill import Backfill
from sgl_pic.store.shared.counts import SharedCounts
from sgl_pic.store.shared.deletion import SharedDeletions
from sgl_pic.store.shared.headers import HeaderCache
from sgl_pic.store.store_link import StoreLink


class SharedWriter:
    """The write side of ``SharedStore``: its ``put``, the write queue (``queue``, one
    thread) and the backfill after an outage (``backfill``), which share it.
    write_queue: writes pending; block_tokens: tokens per checksum block of records
    written; backfill_keys: skipped writes remembered."""

    def __init__(
        self,
        link: StoreLink,
        headers: HeaderCache,
        deletions: SharedDeletions,
        counts: SharedCounts,
        model_digest: str,
        layout: RecordLayout | None,
        write_queue: int,
        block_tokens: int,
        backfill_keys: int,
    ) -> None:
        self.link = link
        self.headers = headers
        self.deletions = deletions
        self.counts = counts
        self.model_digest = model_digest
        self.layout = layout
        self.block_tokens = block_tokens
        self.queue = WriteBack(WriteBackConfig(write_queue), "sgl-pic-shared-write")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._on_write: Callable[[], None] | None = None
        self.backfill = Backfill(
            backfill_keys,
            model_digest,
            block_tokens,
            link,
            deletions,
            self.queue.submit,
            counts.add,
            self.notify,
        )

    def put(self, record: ChunkKV) -> bool:
        """See ``SharedStore.put``."""
        if not self._accepts(record):
            return False
        if not self.link.stats().up:
            self.counts.add("writes_skipped")
            self.backfill.remember(record.key)
            return False
        # Taken now, in the caller's order with the deletions it applies: the write is
        # dropped if a deletion made after now matches, and its header tells readers
        # which tombstones it predates.
        since, seen = self.deletions.marks()
        if not self._claim(record.key):
            return True
        copy = self._host_copy(record)
        if not self.queue.submit(lambda: self._write(copy, since, seen)):
            self._release(record.key)
            return False
        return True

    def _accepts(self, record: ChunkKV) -> bool:
        """False (counted as "foreign_model" or "layout_mismatch") for a record of
        another model, or of a KV layout other than ``layout`` when one is set."""
        if record.model_digest != self.model_digest:
            self.counts.error("foreign_model")
            return False
        if self.layout is not None:
            try:
                self.layout.check_record(record)
            except LayoutMismatchError:
                self.counts.error("layout_mismatch")
                return False
        return True

    def _claim(self, key: str) -> bool:
        """Marks ``key`` pending and returns True; False when it is pending already or
        its header is known (stored), so the caller queues no second write."""
        with self._lock:
            if key in self._pending or key in self.headers:
                return False
            self._pending.add(key)
            return True

    def _release(self, key: str) -> None:
        """Ends ``key``'s pending mark (its write ran, failed or was never queued)."""
        with self._lock:
            self._pending.discard(key)

    def _host_copy(self, record: ChunkKV) -> ChunkKV:
        """``record`` with K, V and ranking copied to host memory; the claim on its key is
        released if the copy raises."""
        # The writer reads the record later, on its own thread: it gets a host copy made
        # now, in the caller's stream order, since the caller may reuse its buffers (on an
        # accelerator, still being filled by queued kernels) once ``put`` returns.
        try:
            return replace(
                record,
                k=record.k.to("cpu", copy=True),
                v=record.v.to("cpu", copy=True),
                ranking=None if record.ranking is None else record.ranking.to("cpu", copy=True),
            )
        except BaseException:
            self._release(record.key)
            raise

    def _write(self, record: ChunkKV, since: int, seen: int) -> None:
        """The queued write of ``record`` (writer thread): dropped if a deletion logged
        after ``since`` matches it, else stored if absent, with ``seen`` (tombstones
        applied at ``put``) in its header. Always releases the key and notifies."""
        try:
            content = record.content()
            if self.deletions.dropped(since, record.namespace, content):
                self.counts.add("deleted_in_flight")
                return
            enc = encode_record(record, self.block_tokens, seen)
            outcome = self.link.call(
                lambda b: b.put_if_absent(record.key, [enc.head, *enc.areas]),
                background=True,
            )
            self.counts.add("stored" if outcome is PutOutcome.STORED else "present")
            if outcome is PutOutcome.STORED:
                self.deletions.wrote(record.key, record.namespace, content, record.nbytes)
        except BackendUnavailable:
            self.counts.add("write_failed")
            self.backfill.remember(record.key)
            raise
        except BackendError:
            self.counts.add("write_failed")
            raise
        finally:
            self._release(record.key)
            self.notify()

    def notify(self) -> None:
        """Calls the ``on_write`` listener, if any (on the writer thread)."""
        with self._lock:
            listener = self._on_write
        if listener is not None:
            listener()

    def on_write(self, listener: Callable[[], None] | None) -> None:
        """See ``SharedStore.on_write``."""
        with self._lock:
            self._on_write = listener
