"""A guarded link to a shared object store: bounded calls and a circuit breaker.

A server must keep serving from its own tiers when the shared store is down, and a store
client may block for seconds inside one call (Mooncake's does while its master is gone).
So every call runs on a small worker pool and is waited for at most ``op_timeout_s``;
a timeout or an unreachable answer opens the breaker: calls fail at once, without
touching the store, until a background probe (every ``retry_s``) finds it answering
again. Requests therefore wait on a dead store at most once per outage, never on the
probes. Joining the store (which may block as long as it is down) runs on its own thread,
retried forever. Each outage is counted once and logged once, and so is the recovery.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from sgl_pic.store.object_backend import BackendUnavailable, ObjectBackend
from sgl_pic.worker_threads import start_thread, thread_pool

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LinkConfig:
    """op_timeout_s: longest wait for one store call a request may be waiting on
                  (lookups, layer loads).
    write_timeout_s: the same for writes and promotions, which run in the background.
    retry_s:      period of the background probe while the store is unreachable.
    workers:      threads running store calls (a call stuck past its timeout holds one).
    """

    op_timeout_s: float = 2.0
    write_timeout_s: float = 10.0
    retry_s: float = 2.0
    workers: int = 4

    def __post_init__(self) -> None:
        if not (
            0.0 < self.op_timeout_s <= 600.0
            and 0.0 < self.write_timeout_s <= 600.0
            and 0.0 < self.retry_s <= 3600.0
        ):
            raise ValueError("timeouts must be in (0, 600] s and retry_s in (0, 3600] s")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be in [1, 64], got {self.workers}")


class LinkStats(NamedTuple):
    """up: reachable now. outages: times it became unreachable (the first failed connect
    counts as one). failed_calls: calls that timed out or found it unreachable.
    skipped_calls: calls refused at once while the breaker was open."""

    up: bool
    outages: int
    failed_calls: int
    skipped_calls: int


class StoreLink:
    """Runs ``ObjectBackend`` calls for a ``SharedStore``. ``call`` raises
    BackendUnavailable when the store is down (quickly, while the breaker is open)."""

    def __init__(self, backend: ObjectBackend, config: LinkConfig, label: str) -> None:
        self.backend = backend
        self.config = config
        self.label = label
        self._lock = threading.Lock()
        self._connected = False
        self._up = False
        self._outages = self._failed = self._skipped = 0
        self._closed = threading.Event()
        self._probing = False
        self._on_recover: list[Callable[[], None]] = []
        # Calls inside the client now: ``close`` must not free it under one of them.
        self._active = 0
        self._idle = threading.Condition(self._lock)
        self._pool = thread_pool(config.workers, "sgl-pic-shared")
        self._connector = start_thread(self._connect_loop, "sgl-pic-shared-connect")

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.backend.connect()
            except BackendUnavailable as exc:
                self._mark_down(f"cannot join: {exc}")
                self._closed.wait(self.config.retry_s)
                continue
            except Exception as exc:  # a client library bug must not kill the server
                self._mark_down(f"cannot join: {type(exc).__name__}: {exc}")
                self._closed.wait(self.config.retry_s)
                continue
            with self._lock:
                closed = self._closed.is_set()
                self._connected = not closed
            if closed:  # ``close`` ran while this thread was joining
                self.backend.close()
                return
            self._mark_up()
            return

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether the link joined the store and took calls within ``timeout_s`` (tests,
        tools). Waits for both: the connect thread marks the link up just after joining,
        and a call made in between is refused."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._connected and self._up:
                    return True
            time.sleep(0.05)
        return False

    def _mark_down(self, why: str) -> None:
        with self._lock:
            self._failed += 1
            was_up, first = self._up, self._outages == 0
            self._up = False
            if was_up or first:
                self._outages += 1
            start_probe = self._connected and not self._probing
            self._probing = self._probing or start_probe
        if start_probe:
            start_thread(self._probe_loop, "sgl-pic-shared-probe")
        if was_up or first:
            logger.warning(
                "sgl_pic: shared store %s unreachable (%s); serving from this server's own "
                "tiers, retrying every %.1f s",
                self.label,
                why,
                self.config.retry_s,
            )

    def _probe_loop(self) -> None:
        """Until the store answers (or the link closes): one cheap query per period, on
        this thread, where blocking inside the client delays no request."""
        while not self._closed.wait(self.config.retry_s):
            try:
                self._run(lambda b: b.exists(["sgl-pic-probe"]))
            except Exception:  # unreachable, or a client error: still not usable
                continue
            with self._lock:
                self._probing = False
            self._mark_up()
            return
        with self._lock:
            self._probing = False

    def on_recover(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` each time the store becomes reachable after an outage (the
        first join after failed ones included), on the thread that found it back: it
        must return quickly and not raise."""
        with self._lock:
            self._on_recover.append(listener)

    def _mark_up(self) -> None:
        with self._lock:
            was_up, self._up = self._up, True
            had_outage = self._outages > 0
            listeners = list(self._on_recover) if not was_up and had_outage else []
        if not was_up:
            logger.info(
                "sgl_pic: shared store %s %s",
                self.label,
                "reachable again" if had_outage else "connected",
            )
        for listener in listeners:
            listener()

    def _run(self, fn: Callable[[ObjectBackend], T]) -> T:
        """``fn(backend)`` on this thread, counted as a call inside the client."""
        with self._lock:
            if self._closed.is_set():
                raise BackendUnavailable("link closed")
            self._active += 1
        try:
            return fn(self.backend)
        finally:
            with self._lock:
                self._active -= 1
                self._idle.notify_all()

    def call(self, fn: Callable[[ObjectBackend], T], background: bool = False) -> T:
        """``fn(backend)`` on a worker, waited for at most ``op_timeout_s``
        (``write_timeout_s`` when ``background``: nobody's request waits). Raises
        BackendUnavailable (the store is down or the breaker open), or what ``fn``
        raised otherwise."""
        with self._lock:
            if not self._up:
                self._skipped += 1
                raise BackendUnavailable("shared store unavailable")
        try:
            future = self._pool.submit(self._run, fn)
        except RuntimeError as exc:  # pool shut down
            raise BackendUnavailable("link closed") from exc
        try:
            limit = self.config.write_timeout_s if background else self.config.op_timeout_s
            result = future.result(timeout=limit)
        except cf.TimeoutError as exc:
            self._mark_down(f"no answer within {limit} s")
            raise BackendUnavailable("timeout") from exc
        except BackendUnavailable as exc:
            self._mark_down(str(exc))
            raise
        self._mark_up()
        return result

    def stats(self) -> LinkStats:
        with self._lock:
            return LinkStats(self._up, self._outages, self._failed, self._skipped)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop connecting and calling, then leave the store once no call is inside the
        client. A call still stuck there after ``wait_s`` keeps the client: it is left to
        process exit rather than freed under that call."""
        with self._lock:
            self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            idle = self._idle.wait_for(lambda: self._active == 0, timeout=wait_s)
            connected, self._connected = self._connected, False
        if connected and not idle:
            logger.warning("sgl_pic: a shared store call is still running; client left open")
        elif connected:
            try:
                self.backend.close()
            except Exception:  # leaving a dead store must not fail shutdown
                logger.debug("closing the shared store client failed", exc_info=True)
