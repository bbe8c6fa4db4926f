"""A bounded background queue: one thread running jobs (host-to-disk writes, promotions,
shared-store writes) off the request's critical path, with flush, a deadline-bounded
shutdown and counts of what it did."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from sgl_pic.store.record.write import WriteCancelled
from sgl_pic.worker_threads import start_thread


class WriteBackStats(NamedTuple):
    """Cumulative counts of one ``WriteBack``.

    dropped:   refused by ``submit`` (queue full, or shut down); never queued.
    cancelled: queued, then dropped by ``shutdown``: never run before its deadline, or
               stopped mid-run (the job raised ``WriteCancelled``).
    """

    submitted: int
    completed: int
    failed: int
    dropped: int
    cancelled: int = 0


class DrainResult(NamedTuple):
    """What ``WriteBack.shutdown`` did with the jobs queued or running when it began.

    completed / failed: ran to the end (or raised) during the drain.
    cancelled: never run, stopped mid-run, or still running when the join gave up.
    joined:    the worker thread has ended.
    """

    completed: int
    failed: int
    cancelled: int
    joined: bool
    seconds: float


@dataclass(frozen=True)
class WriteBackConfig:
    """max_pending: jobs queued before ``submit`` starts dropping (never blocking:
    the caller is on the request's critical path and a cache write may be lost)."""

    max_pending: int = 64

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


class WriteBack:
    """One background thread running jobs (e.g. host-to-disk writes, promotions) off
    the critical path, from a bounded queue. ``flush`` waits for everything submitted
    so far; ``shutdown`` drains within a deadline and stops the thread; ``close`` is a
    shutdown without deadline.

    A job that raises ``WriteCancelled`` (a write stopped by shutdown) counts as
    cancelled, any other exception as failed; the thread keeps serving either way.
    """

    def __init__(self, config: WriteBackConfig, name: str = "sgl-pic-writeback") -> None:
        self.config = config
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], object]] = deque()
        self._running = False  # a job is executing outside the lock
        self._counts: Counter[str] = Counter()
        self._closed = False  # intake stopped (submit drops)
        self._stopping = False  # the thread exits once the queue is empty
        self._thread = start_thread(self._run, name)

    def submit(self, job: Callable[[], object]) -> bool:
        """Queue ``job``; False (counted as dropped) when the queue is full or shut down.
        Never blocks beyond the queue's own lock."""
        with self._cond:
            if self._closed or len(self._jobs) >= self.config.max_pending:
                self._counts["dropped"] += 1
                return False
            self._jobs.append(job)
            self._counts["submitted"] += 1
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = True
            outcome = "completed"
            try:
                job()
            except WriteCancelled:
                outcome = "cancelled"
            except Exception:
                # A failed write only loses a cache entry; keep serving later jobs.
                outcome = "failed"
            with self._cond:
                self._running = False
                self._counts[outcome] += 1
                self._cond.notify_all()

    def _idle_locked(self) -> bool:
        return not self._jobs and not self._running

    def flush(self) -> None:
        """Block until every job submitted before this call has run."""
        with self._cond:
            self._cond.wait_for(self._idle_locked)

    def shutdown(
        self,
        timeout_s: float | None,
        on_deadline: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
        join_s: float = 2.0,
    ) -> DrainResult:
        """Stop taking jobs, run the queued ones until ``timeout_s`` (None: no deadline)
        or until ``stop`` is set, drop the rest unrun, and join the thread.

        on_deadline: called when a job is still running at the deadline, to make it stop
                     early (e.g. ``DiskStore.abort_writes``); the thread then gets
                     ``join_s`` more seconds. A job that outlives that is counted
                     cancelled and its daemon thread left to end on its own.
        Idempotent: a second call changes nothing and reports zeros."""
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + max(0.0, timeout_s)
        with self._cond:
            if self._closed:
                return DrainResult(0, 0, 0, not self._thread.is_alive(), 0.0)
            self._closed = True
            base = Counter(self._counts)
            while not self._idle_locked():
                if stop is not None and stop.is_set():
                    break
                if deadline is None:
                    wait = None if stop is None else 0.05
                else:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        break
                    if stop is not None:
                        wait = min(wait, 0.05)  # polled: ``stop`` has no condition
                self._cond.wait(wait)
            unrun = len(self._jobs)
            self._jobs.clear()
            self._counts["cancelled"] += unrun
            busy = self._running
            self._stopping = True
            self._cond.notify_all()
        if busy and on_deadline is not None:
            on_deadline()
        self._thread.join(None if not busy else join_s)
        joined = not self._thread.is_alive()
        with self._cond:
            gained = Counter(self._counts)
            gained.subtract(base)
        return DrainResult(
            completed=gained["completed"],
            failed=gained["failed"],
            cancelled=gained["cancelled"] + (0 if joined else 1),
            joined=joined,
            seconds=time.monotonic() - t0,
        )

    def close(self) -> None:
        """Run everything queued, then stop the thread (no deadline)."""
        self.shutdown(None)

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> WriteBackStats:
        with self._cond:
            c = self._counts
            return WriteBackStats(
                c["submitted"], c["completed"], c["failed"], c["dropped"], c["cancelled"]
            )
