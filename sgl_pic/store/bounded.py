"""The bookkeeping the host and disk tiers share: the entries they hold with their access
metadata, the bytes held against a capacity and per-namespace caps, eviction in policy
order (``eviction``), locks, deletions and counters.

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
from collections.abc import Iterable
from types import MappingProxyType

from sgl_pic.store.base import ChunkKV, ChunkStore, RecordLayout, StoreStats, check_key
from sgl_pic.store.deletion import DeleteReport, Deletion
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.errors import LayoutMismatchError
from sgl_pic.store.eviction import EntryMeta, eviction_order, gdsf_priority, room_plan, take


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
            take(eviction_order(self._entries, self._policy), self._entries, nbytes)
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
        ns_need = 0
        if self._ns_cap:
            ns_need = (
                self._ns_used[namespace]
                + (incoming if ns_incoming is None else ns_incoming)
                - self._ns_cap
            )
        need = self._used + incoming - self._capacity
        return room_plan(
            self._entries, self._policy, need, namespace, ns_need, self._ns_used, self._ns_cap
        )
