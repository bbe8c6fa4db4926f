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

Fair share: with ``namespace_max_bytes`` set, each namespace (tenant) holds at most that
many bytes. An insert first evicts inside its own namespace until it fits its cap; if the
tier is still full it evicts, in policy order within each group, entries of namespaces
over their cap (after a deletion left locked bytes, say), then its own, and another
namespace's within its cap only when nothing else is left. So one tenant's churn never
evicts another's working set while that one stays within its cap.

Deletion: ``delete`` removes the entries a ``Deletion`` matches (every entry knows its
namespace and segment content digest). A locked entry (a reader will load it) leaves the
index at once, so it is never found again; its bytes stay counted until the last
``unlock``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from sgl_pic.store.base import ChunkKV, ChunkStore, RecordLayout, StoreStats, check_key
from sgl_pic.store.deletion import DeleteReport, Deletion
from sgl_pic.store.deletion_log import DeletionLog
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
    namespace:         the record's isolation namespace (tenant).
    content:           ``deletion.content_digest`` of the record's token ids.
    """

    nbytes: int
    last_access: int
    last_access_time: float
    access_count: int = 0
    locks: int = 0
    priority: float = 0.0  # GDSF's; set by the store on insert and on every access
    namespace: str = ""
    content: str = ""

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


def eviction_order(
    entries: Mapping[str, EntryMeta], policy: str, namespace: str | None = None
) -> list[str]:
    """Keys of unlocked entries (of ``namespace`` only, when given), the first to evict
    first. Locked entries never appear."""
    unlocked = [
        (k, e)
        for k, e in entries.items()
        if e.locks == 0 and (namespace is None or e.namespace == namespace)
    ]
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
    report evicted or forgotten (``_dropped_locked`` / ``_dropped`` after a deletion).

    namespace_max_bytes: each namespace's cap (0: none); see the module docstring.
    deletions:           the log inserts check (``deletion_log``); shared by the tiers of
                         one ``TieredStore``, else the store's own.
    """

    def __init__(
        self,
        model_digest: str,
        capacity_bytes: int,
        policy: str,
        layout: RecordLayout | None = None,
        namespace_max_bytes: int = 0,
        deletions: DeletionLog | None = None,
    ) -> None:
        if namespace_max_bytes < 0:
            raise ValueError(f"namespace_max_bytes must be >= 0, got {namespace_max_bytes}")
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
        self._ns_cap = namespace_max_bytes
        self._ns_used: Counter[str] = Counter()  # bytes per namespace, doomed ones included
        # Deleted while locked: out of the index, bytes counted until the last unlock.
        self._doomed: dict[str, EntryMeta] = {}
        self.deletions = DeletionLog() if deletions is None else deletions

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
        """Release one lock. A key deleted while locked releases its deleted entry first
        (its bytes leave the accounting with the last lock)."""
        with self._lock:
            doomed = self._doomed.get(key)
            if doomed is not None:
                doomed.locks -= 1
                if doomed.locks <= 0:
                    del self._doomed[key]
                    self._release_locked(doomed)
                return
            entry = self._entries.get(key)
            if entry is not None and entry.locks > 0:
                entry.locks -= 1

    def bytes_by_namespace(self) -> dict[str, int]:
        """Bytes held per namespace (deleted-while-locked ones until unlocked), for
        metrics. Changes nothing; safe from any thread."""
        with self._lock:
            return {ns: n for ns, n in self._ns_used.items() if n > 0}

    def delete(self, d: Deletion) -> DeleteReport:
        """Log ``d`` (so inserts still in flight drop what it matches) and remove every
        matching entry: index entry and payload (``remove_matching``). Called from the
        scheduler thread; safe while background writers run."""
        self.deletions.append(d)
        return self.remove_matching(d)

    def remove_matching(self, d: Deletion) -> DeleteReport:
        """Remove the entries ``d`` matches without logging it (the caller logged it in
        ``deletions`` first). Locked entries leave the index now and their bytes with
        their last ``unlock``; the others' bytes are freed now."""
        with self._lock:
            removed: list[tuple[str, int]] = []
            for key, entry in list(self._entries.items()):
                if not d.matches_digest(entry.namespace, entry.content):
                    continue
                del self._entries[key]
                removed.append((key, entry.nbytes))
                if entry.locks == 0:
                    self._release_locked(entry)
                elif key in self._doomed:  # deleted, stored again, locked, deleted again
                    self._doomed[key].locks += entry.locks
                    self._doomed[key].nbytes += entry.nbytes
                else:
                    self._doomed[key] = entry
            self._counts["deleted"] += len(removed)
            self._dropped_locked([k for k, _ in removed])
        self._dropped([k for k, _ in removed])
        return DeleteReport(len(removed), sum(n for _, n in removed))

    def _dropped_locked(self, keys: list[str]) -> None:
        """Hook: drop the payload of deleted ``keys`` (under the lock)."""

    def _dropped(self, keys: list[str]) -> None:
        """Hook: drop the payload of deleted ``keys`` (after the lock is released)."""

    def _release_locked(self, entry: EntryMeta) -> None:
        self._used -= entry.nbytes
        self._ns_used[entry.namespace] -= entry.nbytes
        if self._ns_used[entry.namespace] <= 0:
            del self._ns_used[entry.namespace]

    def _deleted_since_locked(self, since: int, namespace: str, content: str) -> bool:
        """Whether a deletion logged after ``since`` matches; counted as
        "deleted_in_flight" when it does (the insert is then dropped)."""
        if self.deletions.covers(since, namespace, content):
            self._counts["deleted_in_flight"] += 1
            return True
        return False

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

    def _add_locked(
        self,
        key: str,
        nbytes: int,
        last_access_time: float | None = None,
        namespace: str = "",
        content: str = "",
    ) -> None:
        """Index a new entry as the most recently used (its wall time defaults to now)."""
        when = time.time() if last_access_time is None else last_access_time
        priority = gdsf_priority(self._age, 1, nbytes)
        self._entries[key] = EntryMeta(
            nbytes, next(self._clock), when, priority=priority, namespace=namespace, content=content
        )
        self._used += nbytes
        self._ns_used[namespace] += nbytes

    def _forget_locked(self, key: str) -> EntryMeta | None:
        """Drop ``key``'s entry (not counted as an eviction); None when not held."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._release_locked(entry)
        return entry

    def _evict_locked(self, nbytes: int) -> list[tuple[str, int]]:
        """Drop unlocked entries in policy order until ``nbytes`` are freed or none are
        left; (key, nbytes) of each, in eviction order."""
        return self._evict_keys_locked(
            _take(eviction_order(self._entries, self._policy), self._entries, nbytes)
        )

    def _evict_keys_locked(self, keys: Iterable[str]) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for key in keys:
            entry = self._entries.pop(key)
            self._release_locked(entry)
            out.append((key, entry.nbytes))
            self._age = max(self._age, entry.priority)
            self._counts["evictions"] += 1
            self._counts["evicted_bytes"] += entry.nbytes
        return out

    def _make_room_locked(
        self, incoming: int, namespace: str = "", ns_incoming: int | None = None
    ) -> tuple[list[tuple[str, int]], bool]:
        """Evict until ``incoming`` more bytes fit the tier and ``ns_incoming`` (default
        ``incoming``) more fit ``namespace``'s cap; (evicted, whether they fit). A put that
        cannot fit is counted as rejected and evicts nothing."""
        plan = self._room_plan_locked(incoming, namespace, ns_incoming)
        if plan is None:
            # Evicting could not make room (the put exceeds the capacity or the cap, or
            # locked entries hold it): refuse before dropping anything.
            self._counts["rejected_puts"] += 1
            return [], False
        return self._evict_keys_locked(plan), True

    def _room_plan_locked(
        self, incoming: int, namespace: str, ns_incoming: int | None
    ) -> list[str] | None:
        """The keys to evict, in order, for ``_make_room_locked``; None if no choice of
        unlocked entries makes room."""
        entries = self._entries
        need = self._used + incoming - self._capacity
        ns_need = 0
        if self._ns_cap:
            ns_need = (
                self._ns_used[namespace]
                + (incoming if ns_incoming is None else ns_incoming)
                - self._ns_cap
            )
        if need <= 0 and ns_need <= 0:
            return []
        plan: list[str] = []
        if ns_need > 0:
            plan = _take(eviction_order(entries, self._policy, namespace), entries, ns_need)
            if sum(entries[k].nbytes for k in plan) < ns_need:
                return None
            need -= sum(entries[k].nbytes for k in plan)
        if need > 0:
            order = eviction_order(entries, self._policy)
            if self._ns_cap:
                # Over-cap namespaces first, then the inserter's own, then the others;
                # the sort is stable, so each group keeps the policy's order.
                over = {ns for ns, n in self._ns_used.items() if n > self._ns_cap}

                def group(key: str) -> int:
                    ns = entries[key].namespace
                    return 0 if ns in over else 1 if ns == namespace else 2

                order.sort(key=group)
            taken = set(plan)
            more = _take((k for k in order if k not in taken), entries, need)
            if sum(entries[k].nbytes for k in more) < need:
                return None
            plan += more
        return plan


def _take(order: Iterable[str], entries: Mapping[str, EntryMeta], nbytes: int) -> list[str]:
    """The shortest prefix of ``order`` whose entries hold at least ``nbytes`` (all of
    it when they hold fewer)."""
    out: list[str] = []
    freed = 0
    for key in order:
        if freed >= nbytes:
            break
        out.append(key)
        freed += entries[key].nbytes
    return out
