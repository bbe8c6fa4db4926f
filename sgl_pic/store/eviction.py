"""Entry bookkeeping shared by the host and disk tiers: per-entry access metadata, the
eviction order, and the byte-capacity, lock and counter logic built on them.

DARIC (3.3.2) keeps a timestamp and an access count on every cached segment for
eviction; LRU orders by the first, LFU by the second with recency breaking ties.

GDSF (greedy-dual-size-frequency, Cherkasova 1998) weighs all three: an entry's priority is
``age + accesses / size``, refreshed on every access, and the store's age rises to each
evicted entry's priority. A stream of novel chunks, each used once, enters at ``age + 1 /
size`` and leaves before a chunk used k times, until the age has climbed k / size, that is
until the cache has turned over about k times with nothing touching that chunk: LRU would
drop it after one turnover. A hit counts once whatever the chunk's length (the hit rate
counts chunks), so per byte held a small chunk earns more.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from sgl_pic.store.base import ChunkKV, ChunkStore, RecordLayout, StoreStats, check_key
from sgl_pic.store.errors import LayoutMismatchError

EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu", "gdsf")


def gdsf_priority(age: float, accesses: int, size: int) -> float:
    """GDSF's priority of an entry of ``size`` (bytes or slots) used ``accesses`` times,
    at the store's current ``age``."""
    return age + accesses / max(size, 1)


@dataclass
class EntryMeta:
    """Mutable bookkeeping of one entry; only touched under its store's lock.

    last_access:       a logical clock value: strictly ordered even when two accesses
                       fall in one timer tick (wall time alone would tie).
    last_access_time:  wall-clock seconds of the last access (for reporting).
    """

    nbytes: int
    last_access: int
    last_access_time: float
    access_count: int = 0
    locks: int = 0
    priority: float = 0.0  # GDSF's; set by the store on insert and on every access

    def touch(self, clock: itertools.count, age: float) -> None:
        self.last_access = next(clock)
        self.last_access_time = time.time()
        self.access_count += 1
        self.priority = gdsf_priority(age, self.access_count + 1, self.nbytes)


def check_policy(policy: str) -> None:
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"unknown eviction policy {policy!r}; valid: {', '.join(EVICTION_POLICIES)}"
        )


def eviction_order(entries: Mapping[str, EntryMeta], policy: str) -> list[str]:
    """Keys of unlocked entries, the first to evict first. Locked entries never appear."""
    unlocked = [(k, e) for k, e in entries.items() if e.locks == 0]
    if policy == "lfu":
        unlocked.sort(key=lambda ke: (ke[1].access_count, ke[1].last_access))
    elif policy == "gdsf":
        unlocked.sort(key=lambda ke: (ke[1].priority, ke[1].last_access))
    else:
        unlocked.sort(key=lambda ke: ke[1].last_access)
    return [k for k, _ in unlocked]


class BoundedStore(ChunkStore):
    """The bookkeeping the host and disk tiers share: per-entry metadata, the bytes held
    against a capacity, eviction in policy order, locks and counters.

    ``_lock`` guards all of it; methods ending in ``_locked`` expect the caller to hold
    it, so a tier can make a compound step (check, make room, insert) atomic. A tier
    keeps its payload (records, files) itself and drops it for the keys these methods
    report evicted or forgotten.
    """

    def __init__(
        self,
        model_digest: str,
        capacity_bytes: int,
        policy: str,
        layout: RecordLayout | None = None,
    ) -> None:
        self.model_digest = check_key(model_digest)
        # The KV layout every record must have (the serving pool's); None checks none.
        self.layout = layout
        self._capacity = capacity_bytes
        self._policy = policy
        self._lock = threading.Lock()
        self._entries: dict[str, EntryMeta] = {}
        self._clock = itertools.count()
        self._age = 0.0  # GDSF's inflation value: the priority of the last entry evicted
        self._used = 0  # sum of the entries' nbytes, kept so puts need not re-add them
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def lock(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.locks += 1
            return True

    def unlock(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.locks > 0:
                entry.locks -= 1

    def stats(self) -> StoreStats:
        with self._lock:
            c = self._counts
            return StoreStats(
                entries=len(self._entries),
                bytes_used=self._used,
                capacity_bytes=self._capacity,
                hits=c["hits"],
                misses=c["misses"],
                puts=c["puts"],
                rejected_puts=c["rejected_puts"],
                evictions=c["evictions"],
                evicted_bytes=c["evicted_bytes"],
                bytes_read=c["bytes_read"],
                errors=MappingProxyType(dict(self._errors)),
            )

    def _accepts_model(self, record: ChunkKV) -> bool:
        """False (counted as a foreign, rejected put) for another model's record, and
        (counted as "layout_mismatch") for one whose KV layout is not ``layout``."""
        if record.model_digest != self.model_digest:
            kind = "foreign_model"
        else:
            try:
                if self.layout is not None:
                    self.layout.check_record(record)
                return True
            except LayoutMismatchError:
                kind = "layout_mismatch"
        with self._lock:
            self._errors[kind] += 1
            self._counts["rejected_puts"] += 1
        return False

    def _access_locked(self, key: str) -> bool:
        """Refresh ``key``'s access time and count; False, counted as a miss, when the
        key is not held."""
        entry = self._entries.get(key)
        if entry is None:
            self._counts["misses"] += 1
            return False
        entry.touch(self._clock, self._age)
        return True

    def _add_locked(self, key: str, nbytes: int, last_access_time: float | None = None) -> None:
        """Index a new entry as the most recently used (its wall time defaults to now)."""
        when = time.time() if last_access_time is None else last_access_time
        priority = gdsf_priority(self._age, 1, nbytes)
        self._entries[key] = EntryMeta(nbytes, next(self._clock), when, priority=priority)
        self._used += nbytes

    def _forget_locked(self, key: str) -> EntryMeta | None:
        """Drop ``key``'s entry (not counted as an eviction); None when not held."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes
        return entry

    def _evict_locked(self, nbytes: int) -> list[tuple[str, int]]:
        """Drop unlocked entries in policy order until ``nbytes`` are freed or none are
        left; (key, nbytes) of each, in eviction order."""
        out: list[tuple[str, int]] = []
        freed = 0
        for key in eviction_order(self._entries, self._policy):
            if freed >= nbytes:
                break
            entry = self._entries.pop(key)
            self._used -= entry.nbytes
            freed += entry.nbytes
            out.append((key, entry.nbytes))
            self._age = max(self._age, entry.priority)
            self._counts["evictions"] += 1
            self._counts["evicted_bytes"] += entry.nbytes
        return out

    def _make_room_locked(self, incoming: int) -> tuple[list[tuple[str, int]], bool]:
        """Evict until ``incoming`` more bytes fit; (evicted, whether they fit). A put that
        cannot fit is counted as rejected and evicts nothing."""
        need = self._used + incoming - self._capacity
        if need > 0:
            unlocked = sum(e.nbytes for e in self._entries.values() if e.locks == 0)
            if unlocked < need:
                # Evicting could not make room (the put exceeds the capacity, or locked
                # entries hold it): refuse before dropping anything.
                self._counts["rejected_puts"] += 1
                return [], False
        evicted = self._evict_locked(need) if need > 0 else []
        fits = self._used + incoming <= self._capacity
        if not fits:
            self._counts["rejected_puts"] += 1
        return evicted, fits
