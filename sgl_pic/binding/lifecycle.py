"""Process exit of the host/disk tiers in SGLang's scheduler process.

How SGLang 0.5.23 stops its scheduler (the process holding the tiers):

- SIGTERM to the server (its main process): the tokenizer manager's handler
  (``tokenizer_manager.py`` ``SignalHandler.sigterm_handler``) sets ``gracefully_exit``;
  ``sigterm_watchdog`` drains running requests, sends ``ShutdownReq`` to the schedulers,
  waits ``_SCHEDULER_EXIT_TIMEOUT_SECS`` (15 s) and then SIGKILLs whatever is left
  (``kill_process_tree``, ``utils/common.py``). The scheduler leaves its event loop on
  ``ShutdownReq``, returns from ``run_scheduler_process`` and exits normally, so atexit
  handlers run, within those 15 s.
- SIGTERM or SIGINT sent to the whole process group (Ctrl-C, ``kill -- -PGID``, systemd's
  default KillMode): the scheduler installs no handler of its own, so SIGTERM kills it at
  once and SIGINT raises KeyboardInterrupt in it.
- The scheduler sets PR_SET_PDEATHSIG = SIGKILL (``kill_itself_when_parent_died``), so it
  is SIGKILLed whenever the main process dies first.

So ``install_shutdown`` covers atexit (the ShutdownReq path and KeyboardInterrupt) and
SIGTERM/SIGINT received by the scheduler itself: queued disk writes finish within
``timeout_s`` or are dropped cleanly, the tier threads are joined, both outcomes are
counted in ``sgl_pic_shutdown_writes_total`` and logged in one line. No handler runs on
SIGKILL; there the guarantee is the atomic write of ``format.write_record`` (a file is
complete or absent) and the start-up removal of a killed writer's temp file.
"""

from __future__ import annotations

import _thread
import atexit
import logging
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.store.tiered import ShutdownReport

logger = logging.getLogger(__name__)

# Below SGLang's 15 s between ShutdownReq and SIGKILL, with room for the store's 2 s join
# grace and SGLang's own teardown.
DEFAULT_SHUTDOWN_TIMEOUT_S = 8.0
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)

_Handler = Callable[[int, FrameType | None], Any] | int | None


class LifecycleMetrics(Protocol):
    """The part of ``PicMetrics`` the shutdown writes."""

    queue_drops: Any  # prometheus Counter, label "queue"
    shutdown_writes: Any  # prometheus Counter, label "outcome" (completed | dropped)


class ShutdownHook:
    """Runs ``lower.shutdown`` once per process, from whichever comes first: a signal
    (on a helper thread, then the signal is re-delivered to its previous handler) or
    atexit. Build it with ``install_shutdown``."""

    def __init__(
        self,
        lower: LowerTiers,
        metrics: LifecycleMetrics | None,
        timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.lower = lower
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.report: ShutdownReport | None = None
        self._lock = threading.Lock()  # held by the one caller doing the shutdown
        self._hurry = threading.Event()  # a second signal: stop waiting for writes
        self._previous: dict[int, _Handler] = {}
        self._redeliver: set[int] = set()  # signals whose drain is done: chain them
        self._draining = False
        self._main_ident: int | None = None
        self._atexit = False
        # Called first, before the tiers stop (e.g. the executor's promoter, which reads
        # from them): each must return quickly and may raise (logged, then skipped).
        self.before: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ the work
    def run(self, reason: str) -> ShutdownReport:
        """Shut the tiers down (bounded by ``timeout_s``), count the outcome into
        ``shutdown_writes`` and the last queue drops into ``queue_drops``, and log one
        line. Idempotent: later calls wait for the first and return its report. Never
        call it from a signal handler (it takes locks the interrupted code may hold)."""
        with self._lock:
            if self.report is not None:
                return self.report
            for stop in self.before:
                try:
                    stop()
                except Exception:  # noqa: BLE001 - the tiers must still be stopped
                    logger.exception("sgl_pic shutdown: a pre-shutdown step failed")
            report = self.lower.shutdown(self.timeout_s, self._hurry)
            self.report = report
            dropped = report.dropped + report.failed
            if self.metrics is not None:
                # Best effort: a metrics failure must not stop the exit.
                try:
                    self.metrics.shutdown_writes.labels(outcome="completed").inc(report.completed)
                    self.metrics.shutdown_writes.labels(outcome="dropped").inc(dropped)
                    self.lower.export_stats(self.metrics)
                except Exception:  # noqa: BLE001
                    logger.exception("sgl_pic shutdown: exporting metrics failed")
            logger.log(
                logging.WARNING if dropped or not report.joined else logging.INFO,
                "sgl_pic shutdown (%s): queued tier writes completed=%d dropped=%d "
                "(failed=%d), promotions dropped=%d, threads joined=%s, %.2f s of %.1f s",
                reason,
                report.completed,
                dropped,
                report.failed,
                report.promotions_dropped,
                "yes" if report.joined else "no",
                report.seconds,
                self.timeout_s,
            )
            return report

    # ------------------------------------------------------------------ signals
    def install(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        """Registers the atexit hook and, from the main thread only (Python's rule), the
        handlers of ``signals``. A signal that is ignored, or handled outside Python, is
        left alone. Changes process-wide state: ``uninstall`` undoes it."""
        if not self._atexit:
            atexit.register(self._at_exit)
            self._atexit = True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("sgl_pic: not on the main thread; tier shutdown runs at exit only")
            return
        self._main_ident = threading.main_thread().ident
        for sig in signals:
            if sig in self._previous:
                continue
            prev = signal.getsignal(sig)
            if prev is None or prev == signal.SIG_IGN:
                continue
            signal.signal(sig, self._on_signal)
            self._previous[sig] = prev

    def uninstall(self) -> None:
        """Restores the previous handlers (main thread only) and drops the atexit hook."""
        if self._atexit:
            atexit.unregister(self._at_exit)
            self._atexit = False
        if threading.current_thread() is threading.main_thread():
            for sig, prev in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev)
            self._previous.clear()

    def _at_exit(self) -> None:
        self.run("exit")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs on the main thread between two bytecodes of whatever it was doing, maybe
        # holding a store or queue lock: it only starts a thread (or chains), never waits.
        if signum in self._redeliver:
            self._chain(signum, frame)
        elif not self._draining:
            self._draining = True
            # _thread, not threading.Thread: Thread.start takes threading's module lock
            # and waits for the new thread, which deadlocks if the interrupted code (e.g.
            # a layer feed starting its worker) holds that lock.
            _thread.start_new_thread(self._drain_then_redeliver, (signum,))
        else:
            self._hurry.set()  # signalled again while draining: drop what is left

    def _drain_then_redeliver(self, signum: int) -> None:
        try:
            self.run(signal.Signals(signum).name)
        except Exception:  # noqa: BLE001 - the process must still end as asked
            logger.exception("sgl_pic shutdown failed")
        finally:
            self._redeliver.add(signum)
            try:
                # To the main thread, so a blocking system call there is interrupted.
                if self._main_ident is None:
                    raise ProcessLookupError
                signal.pthread_kill(self._main_ident, signum)
            except (ProcessLookupError, OSError):
                signal.raise_signal(signum)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        """What the signal would have done without us: the previous Python handler
        (e.g. KeyboardInterrupt for SIGINT), or the default action (SIGTERM: exit)."""
        prev = self._previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def install_shutdown(
    lower: LowerTiers,
    metrics: LifecycleMetrics | None,
    timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    signals: Iterable[int] = DEFAULT_SIGNALS,
) -> ShutdownHook:
    """Makes the scheduler process stop ``lower``'s tiers cleanly when it exits: on
    SIGTERM/SIGINT (the previous handler runs after the drain, so the process still ends
    as the signal asked) and at exit. Call once per store, from the main thread."""
    hook = ShutdownHook(lower, metrics, timeout_s)
    hook.install(signals)
    return hook
