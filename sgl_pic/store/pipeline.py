"""The per-layer reuse pipeline (CacheTune Appendix B): three paths and per-layer events.

For each layer l:
    load(l)         transfer path: fetch layer l's reused KV (sparse, pre-RoPE);
    prepare(l, x)   recompute path: rotate reused keys (deferred RoPE), recompute the
                    selected tokens' KV from layer l-1's output, scatter both into the
                    layer's working buffer;
    compute(l, y)   forward path: attention and the rest of layer l.

Dependencies: prepare(l) after load(l) (and, with ``prepare_needs_previous_output``,
after compute(l-1), whose output the recomputation reads); compute(l) after prepare(l);
load(l + depth) may start once compute(l) has started, so while layer l computes the
transfer path prefetches layer l + 1 and at most ``depth + 1`` layers are in flight.

Modes: "inorder" runs everything on the calling thread (the reference order);
"threaded" runs load and prepare on two worker threads handing over through one
threading.Event per layer and path; "cuda" issues load and prepare on two CUDA streams
with per-layer CUDA events from one thread. The cuda path needs a GPU and is not
exercised by the CPU test suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

PIPELINE_MODES: tuple[str, ...] = ("inorder", "threaded", "cuda")


@dataclass(frozen=True)
class PipelineConfig:
    """mode:                           "inorder", "threaded" or "cuda".
    prefetch_depth:                 how many layers ahead of compute the transfer path
                                    may run (1 = layer l + 1 during compute(l)).
    prepare_needs_previous_output:  prepare(l) waits for compute(l - 1) (it recomputes
                                    from that layer's output). False when prepare only
                                    rotates and scatters reused KV.
    timeout_s:                      longest wait on one handoff; beyond it the run is
                                    stuck (a bug), and fails loudly instead of hanging.
    """

    mode: str = "threaded"
    prefetch_depth: int = 1
    prepare_needs_previous_output: bool = True
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.mode not in PIPELINE_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; valid: {', '.join(PIPELINE_MODES)}")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class TraceEvent(NamedTuple):
    """One stage of one layer: wall-clock start and end (perf_counter seconds) and the
    thread that ran it. In cuda mode, times are when the work was issued, not run."""

    stage: str  # "load", "prepare" or "compute"
    layer: int
    start: float
    end: float
    thread: str


@dataclass(frozen=True)
class PipelineTrace:
    events: tuple[TraceEvent, ...]
    mode: str
    wall_s: float

    def span(self, stage: str, layer: int) -> TraceEvent:
        for e in self.events:
            if e.stage == stage and e.layer == layer:
                return e
        raise KeyError(f"no {stage} event for layer {layer}")


class _Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[TraceEvent] = []

    def run(self, stage: str, layer: int, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        end = time.perf_counter()
        with self._lock:
            self.events.append(
                TraceEvent(stage, layer, start, end, threading.current_thread().name)
            )
        return out


def _identity(layer: int, x: Any) -> Any:
    return x


def run_layer_pipeline(
    num_layers: int,
    load: Callable[[int], Any],
    compute: Callable[[int, Any], None],
    prepare: Callable[[int, Any], Any] | None = None,
    config: PipelineConfig | None = None,
) -> PipelineTrace:
    """Run every layer through load -> prepare -> compute under ``config.mode``.

    The callables own their data; the pipeline only passes ``load``'s result to
    ``prepare`` and ``prepare``'s to ``compute``, once each, and drops its references
    afterwards. An exception in any path stops the run and is re-raised here.
    """
    cfg = config or PipelineConfig()
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    prep = prepare or _identity
    rec = _Recorder()
    t0 = time.perf_counter()
    if cfg.mode == "inorder":
        for layer in range(num_layers):
            x = rec.run("load", layer, lambda layer=layer: load(layer))
            y = rec.run("prepare", layer, lambda layer=layer, x=x: prep(layer, x))
            rec.run("compute", layer, lambda layer=layer, y=y: compute(layer, y))
    elif cfg.mode == "threaded":
        _run_threaded(num_layers, load, prep, compute, cfg, rec)
    else:
        _run_cuda(num_layers, load, prep, compute, cfg, rec)
    events = tuple(sorted(rec.events, key=lambda e: (e.start, e.end)))
    return PipelineTrace(events, cfg.mode, time.perf_counter() - t0)


class _Aborted(Exception):
    pass


def _run_threaded(
    num_layers: int,
    load: Callable[[int], Any],
    prepare: Callable[[int, Any], Any],
    compute: Callable[[int, Any], None],
    cfg: PipelineConfig,
    rec: _Recorder,
) -> None:
    loaded = [threading.Event() for _ in range(num_layers)]
    prepared = [threading.Event() for _ in range(num_layers)]
    started = [threading.Event() for _ in range(num_layers)]
    computed = [threading.Event() for _ in range(num_layers)]
    abort = threading.Event()
    errors: list[BaseException] = []
    slots_x: dict[int, Any] = {}
    slots_y: dict[int, Any] = {}

    def wait(ev: threading.Event) -> None:
        deadline = time.monotonic() + cfg.timeout_s
        while not ev.wait(0.01):
            if abort.is_set():
                raise _Aborted
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline handoff waited over {cfg.timeout_s} s")
        if abort.is_set():
            raise _Aborted

    def guarded(path: Callable[[], None]) -> Callable[[], None]:
        # The first failure of any path is kept and aborts the others, which then stop
        # at their next handoff instead of waiting out the timeout.
        def run() -> None:
            try:
                path()
            except _Aborted:
                pass
            except BaseException as exc:
                errors.append(exc)
                abort.set()

        return run

    def transfer() -> None:
        for layer in range(num_layers):
            if layer - cfg.prefetch_depth >= 0:
                wait(started[layer - cfg.prefetch_depth])
            slots_x[layer] = rec.run("load", layer, lambda layer=layer: load(layer))
            loaded[layer].set()

    def recompute() -> None:
        for layer in range(num_layers):
            wait(loaded[layer])
            if cfg.prepare_needs_previous_output and layer > 0:
                wait(computed[layer - 1])
            x = slots_x.pop(layer)
            slots_y[layer] = rec.run("prepare", layer, lambda layer=layer, x=x: prepare(layer, x))
            del x
            prepared[layer].set()

    def forward() -> None:
        for layer in range(num_layers):
            wait(prepared[layer])
            started[layer].set()
            y = slots_y.pop(layer)
            rec.run("compute", layer, lambda layer=layer, y=y: compute(layer, y))
            del y
            computed[layer].set()

    workers = [
        threading.Thread(target=guarded(transfer), name="pipeline-transfer", daemon=True),
        threading.Thread(target=guarded(recompute), name="pipeline-recompute", daemon=True),
    ]
    for w in workers:
        w.start()
    try:
        guarded(forward)()
    finally:
        for w in workers:
            w.join()
    if errors:
        raise errors[0]


def _run_cuda(
    num_layers: int,
    load: Callable[[int], Any],
    prepare: Callable[[int, Any], Any],
    compute: Callable[[int, Any], None],
    cfg: PipelineConfig,
    rec: _Recorder,
) -> None:
    """Issue order on three streams; the GPU enforces the handoffs through events.

    Tensors produced on the transfer or recompute stream and consumed on another must
    be protected from the caching allocator with ``Tensor.record_stream`` by the
    callables (they know which tensors they made). Not runnable without a GPU.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("pipeline mode 'cuda' needs a CUDA device")
    main = torch.cuda.current_stream()
    transfer = torch.cuda.Stream()
    recomp = torch.cuda.Stream()
    loaded = [torch.cuda.Event() for _ in range(num_layers)]
    prepared = [torch.cuda.Event() for _ in range(num_layers)]
    computed = [torch.cuda.Event() for _ in range(num_layers)]
    slots: dict[int, Any] = {}

    def issue_load(layer: int) -> None:
        with torch.cuda.stream(transfer):
            slots[layer] = rec.run("load", layer, lambda: load(layer))
            loaded[layer].record(transfer)

    issued = 0
    for layer in range(num_layers):
        # Run the transfer stream ``depth`` layers ahead of the forward stream.
        while issued < min(num_layers, layer + cfg.prefetch_depth + 1):
            issue_load(issued)
            issued += 1
        with torch.cuda.stream(recomp):
            recomp.wait_event(loaded[layer])
            if cfg.prepare_needs_previous_output and layer > 0:
                recomp.wait_event(computed[layer - 1])
            x = slots.pop(layer)
            y = rec.run("prepare", layer, lambda layer=layer, x=x: prepare(layer, x))
            prepared[layer].record(recomp)
        main.wait_event(prepared[layer])
        rec.run("compute", layer, lambda layer=layer, y=y: compute(layer, y))
        computed[layer].record(main)
    main.synchronize()
