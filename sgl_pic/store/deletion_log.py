"""The in-process record of deletions, so work queued before one never brings it back.

Background jobs (host-to-disk write-back, disk-to-host promotion, shared-store writes and
backfill) carry a record they read or were handed earlier. Each takes ``seq`` when it is
queued and, when it adds the record to a tier, asks ``covers(since, ...)`` under that
tier's lock: a deletion logged after ``since`` that matches the record drops it.

Ordering that makes this exact: ``delete`` logs the order first and then removes matching
entries under each tier's lock; an insert checks the log and adds under that same lock.
Either the insert's check sees the order, or the entry it added is there for the removal
to find.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from sgl_pic.store.deletion import Deletion


class DeletionLog:
    """The last ``keep`` deletions of this process, numbered from 1. Thread-safe; its lock
    is taken inside tier locks, never the other way round.

    A job older than the oldest deletion kept (``keep`` deletions later) is treated as
    covered: dropping a cache write loses nothing but time."""

    def __init__(self, keep: int = 1024) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._lock = threading.Lock()
        self._entries: deque[tuple[int, Deletion]] = deque(maxlen=keep)
        self._seq = 0

    @property
    def seq(self) -> int:
        """Deletions logged so far: what a job queued now passes as ``since``."""
        with self._lock:
            return self._seq

    def append(self, d: Deletion) -> int:
        """Log ``d``; its number. Called before the tiers remove what ``d`` matches."""
        with self._lock:
            self._seq += 1
            self._entries.append((self._seq, d))
            return self._seq

    def covers(self, since: int, namespace: str, content: str | Callable[[], str]) -> bool:
        """Whether a deletion logged after ``since`` matches a record of ``namespace``
        whose segment content digest is ``content`` (or computed by it, only when some
        deletion is newer than ``since``). Changes nothing."""
        with self._lock:
            if since >= self._seq:
                return False
            if not self._entries or self._entries[0][0] > since + 1:
                return True  # deletions after ``since`` were forgotten: assume the worst
            newer = [d for seq, d in self._entries if seq > since]
        digest = content() if callable(content) else content
        return any(d.matches_digest(namespace, digest) for d in newer)
