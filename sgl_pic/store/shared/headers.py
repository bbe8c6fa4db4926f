"""The headers of shared-store objects this server read, kept so each is fetched once.

A key names one content, so a verified header never goes stale; one is dropped when a
deletion covers it, when its object proved bad, or when a payload failed its checks
against it (the store may have evicted the object and another server stored the key
anew). The payload checks still catch an object replaced by bad bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from sgl_pic.store.record.header import RecordHeader
from sgl_pic.store.shared.deletion import Known


class HeaderCache:
    """At most ``capacity`` checked headers, the least recently used dropped first.
    Thread-safe: read on the scheduler thread, filled there, consulted by the writer."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._headers: OrderedDict[str, RecordHeader] = OrderedDict()

    def get(self, key: str, touch: bool = True) -> RecordHeader | None:
        """The key's header, or None; ``touch`` marks it most recently used."""
        with self._lock:
            header = self._headers.get(key)
            if header is not None and touch:
                self._headers.move_to_end(key)
            return header

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._headers

    def __len__(self) -> int:
        with self._lock:
            return len(self._headers)

    def put(self, key: str, header: RecordHeader) -> None:
        """Keeps ``header`` for ``key``, dropping the least recently used past capacity."""
        with self._lock:
            self._headers[key] = header
            while len(self._headers) > self._capacity:
                self._headers.popitem(last=False)

    def forget(self, key: str) -> None:
        with self._lock:
            self._headers.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._headers.clear()

    def known(self) -> dict[str, Known]:
        """(namespace, content digest, payload bytes) of every key held, for deletions."""
        with self._lock:
            return {k: (h.namespace, h.content, h.payload_bytes) for k, h in self._headers.items()}
