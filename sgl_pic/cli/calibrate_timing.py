"""Timing for calibration: median wall time of a call that waits for the device's queued
work, and a per-token cost taken as the slope between two sizes so a fixed per-call cost
does not inflate it. Offline only (``sgl_pic.cli.calibrate``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def no_sync() -> None:
    """Nothing to wait for (a CPU device)."""
    return None


def device_sync(device: str | torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work: CUDA kernels run asynchronously, so a
    timer that did not wait would time their launch, not their run."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return no_sync


def time_call(
    fn: Callable[[], object],
    repeats: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] = no_sync,
) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs;
    ``sync`` waits for the device before the clock starts and before it stops."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def per_token_cost(
    run: Callable[[int], object],
    small: int,
    large: int,
    repeats: int = 5,
    sync: Callable[[], None] = no_sync,
) -> float:
    """Seconds per token of ``run(n)``, as the slope between n = small and n = large, so
    a fixed per-call cost (launch, file open) does not inflate the per-token rate."""
    if not 0 < small < large:
        raise ValueError(f"need 0 < small < large, got {small}, {large}")
    t_small = time_call(lambda: run(small), repeats, sync=sync)
    t_large = time_call(lambda: run(large), repeats, sync=sync)
    return max(0.0, (t_large - t_small) / (large - small))
