"""Per-entry access metadata and the eviction order shared by the host and disk tiers.

DARIC (3.3.2) keeps a timestamp and an access count on every cached segment for
eviction; LRU orders by the first, LFU by the second with recency breaking ties.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass

EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu")


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

    def touch(self, clock: itertools.count) -> None:
        self.last_access = next(clock)
        self.last_access_time = time.time()
        self.access_count += 1


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
    else:
        unlocked.sort(key=lambda ke: ke[1].last_access)
    return [k for k, _ in unlocked]
