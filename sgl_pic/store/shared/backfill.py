"""The shared tier's backfill: keys of writes skipped while the store was unreachable, and
the one background job that writes those this server still holds once it is back, so an
outage does not leave the chunks computed during it out of the shared tier for good."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from sgl_pic.store.base import ChunkKV
from sgl_pic.store.object_backend import BackendError, BackendUnavailable, PutOutcome
from sgl_pic.store.record.encode import encode_record
from sgl_pic.store.shared.deletion import SharedDeletions
from sgl_pic.store.store_link import StoreLink

logger = logging.getLogger(__name__)


class Backfill:
    """keep:        keys remembered (the oldest forgotten first).
    submit:         queues a job on the shared tier's writer thread; False when full.
    count:          adds to one of the shared tier's counters.
    notify:         called on the writer thread after the job (the tier's write listener).

    ``remember`` is called from any thread; ``on_recover`` from the link's probe;
    ``run`` on the writer thread."""

    def __init__(
        self,
        keep: int,
        model_digest: str,
        block_tokens: int,
        link: StoreLink,
        deletions: SharedDeletions,
        submit: Callable[[Callable[[], None]], bool],
        count: Callable[[str, int], None],
        notify: Callable[[], None],
    ) -> None:
        self._keep = keep
        self._model = model_digest
        self._block_tokens = block_tokens
        self._link = link
        self._deletions = deletions
        self._submit = submit
        self._count = count
        self._notify = notify
        self._lock = threading.Lock()
        self._missed: OrderedDict[str, None] = OrderedDict()
        self._source: Callable[[str], ChunkKV | None] | None = None

    def set_source(self, source: Callable[[str], ChunkKV | None]) -> None:
        """Where a remembered key's record is read from (this server's own tiers; None
        when they no longer hold it). Called on the writer thread; it must not raise."""
        with self._lock:
            self._source = source

    def remember(self, key: str) -> None:
        """A write of ``key`` was skipped: write it when the store is back."""
        with self._lock:
            self._missed[key] = None
            self._missed.move_to_end(key)
            while len(self._missed) > self._keep:
                self._missed.popitem(last=False)

    def on_recover(self) -> None:
        """The store is back: one queued job writes the remembered keys still held here."""
        with self._lock:
            if self._source is None or not self._missed:
                return
        if not self._submit(self.run):
            logger.warning("sgl_pic: shared write queue full; backfill waits for the next outage")

    def run(self) -> None:
        # Before any record is read: what is deleted after this is dropped below, and
        # the headers name the tombstones applied before this.
        since, seen = self._deletions.marks()
        with self._lock:
            keys, self._missed = list(self._missed), OrderedDict()
            source = self._source
        assert source is not None
        written = 0
        for i, key in enumerate(keys):
            record = source(key)
            if record is None or record.model_digest != self._model:
                continue  # no longer held here: nothing to give
            content = record.content()
            if self._deletions.dropped(since, record.namespace, content):
                self._count("deleted_in_flight", 1)
                continue
            try:
                enc = encode_record(record, self._block_tokens, seen)
                outcome = self._link.call(
                    lambda b, r=record, e=enc: b.put_if_absent(r.key, [e.head, *e.areas]),
                    background=True,
                )
            except BackendUnavailable:
                for rest in keys[i:]:
                    self.remember(rest)  # down again: the rest wait for the next recovery
                self._count("write_failed", 1)
                break
            except BackendError:
                self._count("write_failed", 1)
                continue
            self._count("stored" if outcome is PutOutcome.STORED else "present", 1)
            if outcome is PutOutcome.STORED:
                self._deletions.wrote(record.key, record.namespace, content, record.nbytes)
            written += outcome is PutOutcome.STORED
        self._count("backfilled", written)
        self._notify()
        if written:
            logger.info("sgl_pic: shared store back; %d skipped segment(s) written", written)
