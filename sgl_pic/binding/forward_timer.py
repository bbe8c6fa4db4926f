"""Seconds the model runner spends in its forwards, by kind: the Prometheus counter
``sgl_pic_forward_seconds_total{mode="extend"|"mixed"|"decode"|"other"}``, with the
forwards themselves (``sgl_pic_forwards_total``) and the requests in them
(``sgl_pic_forward_requests_total``) by the same kinds.

Reuse shortens extend forwards and nothing else (decode, request handling and scheduling
are the same with it or without), so the time a server spends in them bounds what reuse can
gain; ``bench/workloads.py`` builds its ideal from it. SGLang's own
``sglang:forward_execution_seconds_total`` times forwards with device events, which the CPU
backend lacks.

``plugin.register`` installs it in every server that loads the plugin, ``--pic-disable``
included: it reads the clock and changes nothing. It reads the host's clock, so on an
accelerator, where a forward returns once its kernels are queued, these are host seconds
(use SGLang's device timer there, ``SGLANG_ENABLE_METRICS_DEVICE_TIMER``). A forward of
sgl-pic's chunk path (assembly, phase 1, the probe, phase 2) is one extend forward here.

The counts separate a decode step's cost from how requests batched: two servers given the
same stream decode the same tokens, but a server whose prefill finishes sooner may run
them in more steps of fewer requests each, which costs more seconds on a CPU (each step
reads every weight) without any step being slower.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

# An AROUND hook on it sees every forward of the scheduler's model runner, extend and
# decode alike, whichever attention backend planned it.
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
METRIC = "sgl_pic_forward_seconds"
FORWARDS_METRIC = "sgl_pic_forwards"
REQUESTS_METRIC = "sgl_pic_forward_requests"
MODES = ("extend", "mixed", "decode", "other")


def mode_of(forward_batch: Any) -> str:
    """The label of a forward: "decode", "mixed" (extend and decode rows together),
    "extend", or "other" (idle, speculative steps SGLang counts as neither)."""
    fm = getattr(forward_batch, "forward_mode", None)
    if fm is None:
        return "other"
    if fm.is_decode():
        return "decode"
    if fm.is_mixed():
        return "mixed"
    return "extend" if fm.is_extend() else "other"


class Counts(NamedTuple):
    forwards: Any  # prometheus Counter: forwards by mode
    requests: Any  # prometheus Counter: requests in them by mode (a decode step's batch)


def _mode_counter(name: str, documentation: str) -> Any:
    """A Prometheus counter labelled by forward kind, every series present from the
    start, at 0."""
    from prometheus_client import Counter

    counter = Counter(name, documentation, ["mode"])
    for mode in MODES:
        counter.labels(mode=mode)
    return counter


class ForwardTimer:
    """The counters of one process and the hook that feeds them. ``plugin.register`` makes
    one per process and registers its bound ``timed_forward`` with SGLang's HookRegistry,
    which then holds it: no module state. Its counters are made on first use, in the
    process that runs forwards (the scheduler): SGLang sets PROMETHEUS_MULTIPROC_DIR before
    it spawns the scheduler, so counters made there are ones /metrics reads. Worker side:
    called on the scheduler's forward thread."""

    def __init__(self) -> None:
        self._seconds: Any = None  # the seconds Counter, once made
        self._counts: Counts | None = None  # the two count Counters, once made
        self._warned = False  # whether a failure to count was logged

    def seconds_counter(self) -> Any:
        """The seconds counter, made on first use."""
        if self._seconds is None:
            self._seconds = _mode_counter(METRIC, "Seconds in model-runner forwards, by kind")
        return self._seconds

    def count_counters(self) -> Counts:
        """The forward and request counters, made on first use."""
        if self._counts is None:
            self._counts = Counts(
                _mode_counter(FORWARDS_METRIC, "Model-runner forwards, by kind"),
                _mode_counter(REQUESTS_METRIC, "Requests in model-runner forwards, by kind"),
            )
        return self._counts

    def timed_forward(
        self, original: Any, runner: Any, forward_batch: Any, *args: Any, **kw: Any
    ) -> Any:
        """AROUND hook on ``ModelRunner.forward``: SGLang's forward, its seconds, itself
        and its requests counted by kind, also when it raises."""
        t0 = time.perf_counter()
        try:
            return original(runner, forward_batch, *args, **kw)
        finally:
            elapsed = time.perf_counter() - t0
            try:
                mode = mode_of(forward_batch)
                self.seconds_counter().labels(mode=mode).inc(elapsed)
                counts = self.count_counters()
                counts.forwards.labels(mode=mode).inc()
                size = int(getattr(forward_batch, "batch_size", 0) or 0)
                counts.requests.labels(mode=mode).inc(size)
            except Exception:
                # A metric that cannot be written (its multiprocess file, say) must not
                # stop the scheduler: SGLang ends the server when a scheduler raises.
                if not self._warned:
                    self._warned = True
                    logger.exception("sgl_pic: forward seconds not counted")
