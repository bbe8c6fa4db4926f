"""Eviction of the host and disk tiers: per-entry access metadata, the eviction order of
each policy, and the plan of which entries to evict so an insert fits the tier and its
namespace's cap. Pure functions over the entries; the tiers' bookkeeping built on them,
with the lock, capacity and counters, is ``sgl_pic.store.bounded.BoundedStore``.

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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


def room_plan(
    entries: Mapping[str, EntryMeta],
    policy: str,
    need: int,
    namespace: str,
    ns_need: int,
    ns_used: Mapping[str, int],
    ns_cap: int,
) -> list[str] | None:
    """The keys to evict, in order, so that ``need`` more bytes fit the tier and
    ``ns_need`` more fit ``namespace``'s cap ``ns_cap`` (0: no caps; ``ns_used``: bytes
    held per namespace): first inside ``namespace`` for its cap, then over-cap
    namespaces, the inserter's own, and the others (see the module docstring). None if
    no choice of unlocked entries makes room. Changes nothing."""
    if need <= 0 and ns_need <= 0:
        return []
    plan: list[str] = []
    if ns_need > 0:
        plan = take(eviction_order(entries, policy, namespace), entries, ns_need)
        if sum(entries[k].nbytes for k in plan) < ns_need:
            return None
        need -= sum(entries[k].nbytes for k in plan)
    if need > 0:
        order = eviction_order(entries, policy)
        if ns_cap:
            # Over-cap namespaces first, then the inserter's own, then the others;
            # the sort is stable, so each group keeps the policy's order.
            over = {ns for ns, n in ns_used.items() if n > ns_cap}

            def group(key: str) -> int:
                ns = entries[key].namespace
                return 0 if ns in over else 1 if ns == namespace else 2

            order.sort(key=group)
        taken = set(plan)
        more = take((k for k in order if k not in taken), entries, need)
        if sum(entries[k].nbytes for k in more) < need:
            return None
        plan += more
    return plan


def take(order: Iterable[str], entries: Mapping[str, EntryMeta], nbytes: int) -> list[str]:
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
