"""What the shared tier counts: hits, misses and bytes read; writes by outcome; bad
objects by kind. Reads count on the scheduler thread, writes on the writer thread."""

from __future__ import annotations

import threading
from collections import Counter
from types import MappingProxyType

from sgl_pic.store.base import StoreStats


class SharedCounts:
    """Thread-safe counters of one ``SharedStore``. Names: "hits", "misses",
    "bytes_read", "tombstoned"; writes "stored", "present", "write_failed",
    "writes_skipped", "deleted_in_flight", "backfilled". Error kinds as in
    ``StoreStats.errors``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind] += 1

    def store_stats(self, entries: int) -> StoreStats:
        """The tier's ``StoreStats`` (``entries``: headers held; it keeps no bytes)."""
        with self._lock:
            c = Counter(self._counts)
            errors = dict(self._errors)
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
        """See ``SharedStore.write_counts``."""
        with self._lock:
            c = self._counts
            return {
                "stored": c["stored"],
                "present": c["present"],
                "failed": c["write_failed"],
                "skipped": c["writes_skipped"],
                "backfilled": c["backfilled"],
            }
