"""Promotion of lower-tier hits into host memory in the background: a sparse disk or
shared hit queues one full read of the record, so the next request hits in host memory.
A key is queued once at a time; a queue that is full drops the promotion (counted by
the queue). A deletion made after a promotion was queued drops what it matches when the
promotion runs, instead of bringing it back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.disk.store import DiskStore
from sgl_pic.store.host import HostStore
from sgl_pic.store.shared.store import SharedStore
from sgl_pic.store.write_back import WriteBack


class Promotions:
    """Queues promotions of ``TieredStore``'s tiers on ``queue`` (whose thread runs them;
    the tiered store owns it and shuts it down). ``queue`` is called from the scheduler
    thread (``get_layers``)."""

    def __init__(
        self,
        queue: WriteBack,
        host: HostStore,
        disk: DiskStore,
        shared: SharedStore | None,
        deletions: DeletionLog,
    ) -> None:
        self._queue = queue
        self.host = host
        self.disk = disk
        self.shared = shared
        self.deletions = deletions
        self._lock = threading.Lock()
        self._promoting: set[str] = set()

    def queue(self, key: str, token_ids: Sequence[int] | None) -> None:
        """Queues the promotion of ``key`` unless one is queued or running."""
        with self._lock:
            if key in self._promoting:
                return
            self._promoting.add(key)
        since = self.deletions.seq

        def promote() -> None:
            try:
                if not self.host.contains(key):
                    record = self.disk.get(key, token_ids)
                    if record is None and self.shared is not None:
                        record = self.shared.get(key, token_ids)
                    if record is not None:
                        # Dropped if a deletion made since it was queued matches.
                        self.host.insert(record, write_back=False, since=since)
            finally:
                with self._lock:
                    self._promoting.discard(key)

        if not self._queue.submit(promote):
            with self._lock:
                self._promoting.discard(key)
