"""The disk tier's effective capacity after a full disk: lowered to what the tier holds
when a write fails with ENOSPC or EDQUOT, grown back by half the free space
``os.statvfs`` reports, at most to the configured capacity and at most once per
interval (see ``sgl_pic.store.disk.store``). Half, since the free space is shared (with other
writers and with our writes in flight, which may already have taken part of it):
repeated checks approach the disk's size without overshooting it; an overshoot (someone
else filled it) only costs one failed write that lowers the capacity again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class CapacityRegrowth:
    """When a lowered capacity is checked again, and what it grows to. Holds only the
    time of the next check; ``lowered``, ``due`` and ``grown`` run under the disk
    tier's lock, ``free_bytes`` outside it."""

    def __init__(self, root: Path, configured: int, interval_s: float) -> None:
        self.root = root
        self.configured = configured
        self.interval_s = interval_s
        # time.monotonic() before which the lowered capacity is not checked for regrowth.
        self.next_check = 0.0

    def lowered(self, capacity: int, held: int) -> int:
        """The capacity after a write found the disk full: no more than ``held`` (the
        bytes held and reserved by writes in flight, whose reservations already fit).
        Nothing is evicted for it: the failed record is not retried, and whether a later
        one needs the room is that put's to decide."""
        self.next_check = time.monotonic() + self.interval_s
        return min(capacity, held)

    def due(self, capacity: int) -> bool:
        """Whether a lowered ``capacity`` is checked for regrowth now (then the next
        check waits ``interval_s``)."""
        now = time.monotonic()
        if capacity >= self.configured or now < self.next_check:
            return False
        self.next_check = now + self.interval_s
        return True

    def free_bytes(self) -> int | None:
        """The free bytes the file system reports; None when it cannot say."""
        try:
            st = os.statvfs(self.root)
        except (OSError, AttributeError):  # AttributeError: no statvfs on this platform
            return None
        return st.f_bavail * st.f_frsize

    def grown(self, capacity: int, held: int, free: int) -> int:
        """``capacity`` grown by half of ``free`` beyond ``held``, at most the configured."""
        return min(self.configured, max(capacity, held + free // 2))
