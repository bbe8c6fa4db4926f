"""The bounded stop of the tiered store's background work at process exit: promotions
skipped, the host's write-back to disk given the time there is, the disk closed to
writes so no partial file of ours remains, then the shared tier's queued writes given
what time is left. Called once, from the scheduler process's shutdown.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from sgl_pic.store.disk.store import DiskStore
from sgl_pic.store.host import HostStore
from sgl_pic.store.shared.store import SharedStore
from sgl_pic.store.write_back import WriteBack


class ShutdownReport(NamedTuple):
    """What ``TieredStore.shutdown`` did with the disk writes queued when it began.

    completed:  written (or found unnecessary) before the deadline.
    failed:     ran and failed (I/O error, e.g. ENOSPC; counted in the disk's errors).
    dropped:    never run, or stopped before their rename: no file, no temp file.
    promotions_dropped: queued promotions (disk -> host reads) skipped.
    joined:     the writer and promoter threads have ended.
    seconds:    time the shutdown took.
    """

    completed: int
    failed: int
    dropped: int
    promotions_dropped: int
    joined: bool
    seconds: float
    shared_dropped: int = 0  # queued writes to the shared tier not run


def shutdown_tiers(
    promoter: WriteBack,
    host: HostStore,
    disk: DiskStore,
    shared: SharedStore | None,
    timeout_s: float,
    stop: threading.Event | None,
    join_s: float,
) -> ShutdownReport:
    """See ``TieredStore.shutdown``; ``promoter`` is its promotion queue."""
    t0 = time.monotonic()
    deadline = t0 + max(0.0, timeout_s)
    promo = promoter.shutdown(0.0, stop=stop, join_s=min(join_s, timeout_s))
    remaining = max(0.0, deadline - time.monotonic())
    writes = host.shutdown(remaining, disk.abort_writes, stop, join_s)
    disk.abort_writes()
    # Local writes first: the shared tier gets what time is left (its copy is one
    # other servers could recompute; a local file is this server's after a restart).
    shared_dropped = 0 if shared is None else shared.shutdown(max(0.0, deadline - time.monotonic()))
    if writes is None:
        completed = failed = dropped = 0
        joined = True
    else:
        completed, failed, dropped = writes.completed, writes.failed, writes.cancelled
        joined = writes.joined
    return ShutdownReport(
        completed=completed,
        failed=failed,
        dropped=dropped,
        promotions_dropped=promo.cancelled,
        joined=joined and promo.joined,
        seconds=time.monotonic() - t0,
        shared_dropped=shared_dropped,
    )
