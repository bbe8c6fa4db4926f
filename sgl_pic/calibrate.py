"""Calibrate CacheTune's recompute ratio r per storage tier (Section 4.3, Appendix C).

Measures t_c (recompute, per token per layer), t_i (load, per token per layer, per
tier) and t_o (fixed per-layer pipeline overhead), then picks r by warm-started
golden-section search, either over the cost model or over measured pipeline runs.

The measuring functions take callables, so the engine can supply its real layer forward
and real tier reads. The CLI has no engine: its compute cost comes from a PROXY, the
dense matmuls of one SmolLM2-135M decoder layer in torch (no attention, no norms, no
real weights), and its loads from host-memory and disk tiers holding KV of the
embedded model's shape (30 layers, 3 KV heads, head dim 64, float32).

    python -m sgl_pic.calibrate [--cache-dir DIR] [--tokens 512] [--objective model]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_pic.paths import cache_root
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.base import ChunkKV, ChunkStore
from sgl_pic.store.cost_model import (
    CostParams,
    SearchConfig,
    SearchResult,
    balance_ratio,
    choose_ratio,
    ttft,
)
from sgl_pic.store.disk import DiskStore, DiskStoreConfig
from sgl_pic.store.host import HostStore, HostStoreConfig
from sgl_pic.store.loader import ChunkPlacement, LoaderConfig, SparseLoader
from sgl_pic.store.pipeline import PipelineConfig, run_layer_pipeline

RESULT_FILE = "calibration.json"


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the proxy and the KV records use (SmolLM2-135M defaults)."""

    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    hidden: int = 576
    num_heads: int = 9
    intermediate: int = 1536
    rope_theta: float = 100000.0
    dtype: str = "float32"


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def per_token_cost(run: Callable[[int], object], small: int, large: int, repeats: int = 5) -> float:
    """Seconds per token of ``run(n)``, as the slope between n = small and n = large, so
    a fixed per-call cost (launch, file open) does not inflate the per-token rate."""
    if not 0 < small < large:
        raise ValueError(f"need 0 < small < large, got {small}, {large}")
    t_small = time_call(lambda: run(small), repeats)
    t_large = time_call(lambda: run(large), repeats)
    return max(0.0, (t_large - t_small) / (large - small))


def measure_overhead(num_layers: int, repeats: int = 5) -> float:
    """t_o: seconds per layer the threaded pipeline spends on its own handoffs (runs
    with no-op load, prepare and compute)."""
    cfg = PipelineConfig(mode="threaded")

    def run() -> None:
        run_layer_pipeline(num_layers, lambda i: None, lambda i, y: None, lambda i, x: x, cfg)

    return time_call(run, repeats) / num_layers


class MatmulProxy:
    """A PROXY for one decoder layer's recompute cost: the q/k/v/o projections and the
    gated MLP of the model's shape as plain matmuls on random weights. It ignores
    attention over the context, norms and the real kernels; the engine should pass its
    real layer forward instead."""

    def __init__(self, shape: ModelShape, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        h, d = shape.hidden, shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d

        def w(*s: int) -> torch.Tensor:
            return torch.randn(*s, generator=g) / math.sqrt(s[0])

        self.w_qkv = w(h, qkv)  # [hidden, (heads + 2 kv_heads) * head_dim]
        self.w_o = w(shape.num_heads * d, h)  # [heads * head_dim, hidden]
        self.w_gu = w(h, 2 * shape.intermediate)  # [hidden, 2 * intermediate]
        self.w_down = w(shape.intermediate, h)  # [intermediate, hidden]
        self.q_width = shape.num_heads * d
        self.hidden = h

    def __call__(self, num_tokens: int) -> torch.Tensor:
        """# [num_tokens, hidden] output for random inputs of ``num_tokens`` tokens."""
        x = torch.randn(num_tokens, self.hidden)
        q = (x @ self.w_qkv)[:, : self.q_width]
        x = x + q @ self.w_o
        gate, up = (x @ self.w_gu).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ self.w_down


def make_record(shape: ModelShape, num_tokens: int, model_digest: str, seed: int = 0) -> ChunkKV:
    """A random pre-RoPE record of the model's KV shape."""
    g = torch.Generator().manual_seed(seed)
    dims = (shape.num_layers, num_tokens, shape.num_kv_heads, shape.head_dim)
    tokens = tuple(range(num_tokens))
    key = hashlib.sha256(f"calibrate:{seed}:{num_tokens}".encode()).hexdigest()
    return ChunkKV(
        key=key,
        model_digest=model_digest,
        token_ids=tokens,
        k=torch.randn(dims, generator=g),
        v=torch.randn(dims, generator=g),
        ranking=torch.rand(num_tokens, generator=g),
    )


def _drop_page_cache(path: Path) -> None:
    # Best effort cold read: drop this file's clean pages (no root needed on Linux).
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tier_loader(
    store: ChunkStore,
    record: ChunkKV,
    shape: ModelShape,
    cold: Callable[[], None] | None = None,
) -> Callable[[int], object]:
    """``run(n)``: the reuse path's load of n tokens of ``record`` through every layer, as
    the engine does it (sparse fetch from ``store``, then deferred RoPE); the
    caller divides the slope by the layer count. One layer alone is too short to time
    against a file open and the timer's noise."""
    loader = SparseLoader(store, default_inv_freq(shape.head_dim, shape.rope_theta), LoaderConfig())
    n_all = record.num_tokens

    def run(n: int) -> object:
        if cold is not None:
            cold()
        # The first n_all - n tokens are "recomputed", so exactly n are loaded.
        chunk = ChunkPlacement(record.key, n_all, 0, torch.arange(0, n_all - n))
        return [loader.load_layer([chunk], layer) for layer in range(record.num_layers)]

    return run


def pipeline_objective(
    store: ChunkStore,
    record: ChunkKV,
    compute: Callable[[int], object],
    shape: ModelShape,
    repeats: int = 3,
    cold: Callable[[], None] | None = None,
) -> Callable[[float], float]:
    """Measured TTFT(r): the threaded pipeline over all layers, loading the reuse
    complement of a random recompute set of ceil(r N) tokens and computing those."""
    n = record.num_tokens
    loader = SparseLoader(store, default_inv_freq(shape.head_dim, shape.rope_theta), LoaderConfig())
    cfg = PipelineConfig(mode="threaded")

    def measure(r: float) -> float:
        k = min(n, math.ceil(r * n))
        recompute = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k]
        chunk = ChunkPlacement(record.key, n, 0, recompute)

        def run() -> None:
            if cold is not None:
                cold()
            run_layer_pipeline(
                shape.num_layers,
                lambda layer: loader.fetch_layer([chunk], layer),
                lambda layer, y: compute(k),
                lambda layer, x: loader.rotate(x),
                cfg,
            )

        return time_call(run, repeats)

    return measure


@dataclass(frozen=True)
class TierCalibration:
    t_i: float
    balance_r: float
    r: float
    modelled_ttft_s: float
    probes: int


@dataclass(frozen=True)
class CalibrationResult:
    shape: ModelShape
    num_tokens: int
    t_c: float
    t_o: float
    r_min: float
    tol: float
    objective: str
    compute_source: str
    tiers: dict[str, TierCalibration]
    machine: str
    created: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def calibrate(
    cache_dir: Path,
    shape: ModelShape,
    num_tokens: int,
    search: SearchConfig,
    objective: str = "model",
    compute: Callable[[int], object] | None = None,
    repeats: int = 5,
) -> CalibrationResult:
    """Measure t_c, t_o and per-tier t_i, and choose r per tier. ``compute(n)`` runs one
    layer's recompute of n tokens; None uses ``MatmulProxy`` (a proxy)."""
    if objective not in ("model", "measured"):
        raise ValueError(f"objective must be 'model' or 'measured', got {objective!r}")
    compute_fn = compute if compute is not None else MatmulProxy(shape)
    model_digest = hashlib.sha256(f"calibrate:{shape}".encode()).hexdigest()
    record = make_record(shape, num_tokens, model_digest)
    small, large = max(1, num_tokens // 8), num_tokens
    t_c = per_token_cost(compute_fn, small, large, repeats)
    t_o = measure_overhead(shape.num_layers, repeats)
    tiers: dict[str, TierCalibration] = {}
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix="calib-disk-") as tmp:
        host = HostStore(HostStoreConfig(capacity_bytes=2 * record.nbytes), model_digest)
        disk = DiskStore(DiskStoreConfig(root=tmp, capacity_bytes=4 * record.nbytes), model_digest)
        host.put(record)
        if not disk.put(record):
            raise OSError(f"could not write the calibration record under {tmp}")
        path = disk.path_of(record.key)
        stores: dict[str, tuple[ChunkStore, Callable[[], None] | None]] = {
            "host": (host, None),
            "disk": (disk, lambda: _drop_page_cache(path)),
        }
        for name, (store, cold) in stores.items():
            t_i = (
                per_token_cost(tier_loader(store, record, shape, cold), small, large, repeats)
                / shape.num_layers
            )
            params = CostParams(t_c, t_i, t_o, shape.num_layers, num_tokens)
            obj = (
                None
                if objective == "model"
                else pipeline_objective(store, record, compute_fn, shape, cold=cold)
            )
            res: SearchResult = choose_ratio(params, search, obj)
            tiers[name] = TierCalibration(
                t_i=t_i,
                balance_r=balance_ratio(params, search.r_min),
                r=res.r,
                modelled_ttft_s=ttft(params, res.r),
                probes=len(res.probes),
            )
    return CalibrationResult(
        shape=shape,
        num_tokens=num_tokens,
        t_c=t_c,
        t_o=t_o,
        r_min=search.r_min,
        tol=search.tol,
        objective=objective,
        compute_source="supplied" if compute is not None else "matmul proxy (not the real model)",
        tiers=tiers,
        machine=f"{platform.machine()} {platform.processor()} torch {torch.__version__}",
        created=time.time(),
    )


def _default_cache_dir() -> Path:
    return cache_root() / "calibration"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_pic.calibrate", description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=512, help="reused tokens N")
    parser.add_argument("--r-min", type=float, default=0.15)
    parser.add_argument("--tol", type=float, default=0.01)
    parser.add_argument("--objective", choices=("model", "measured"), default="model")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or _default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    result = calibrate(
        cache_dir,
        ModelShape(),
        args.tokens,
        SearchConfig(r_min=args.r_min, tol=args.tol),
        args.objective,
        repeats=args.repeats,
    )
    out = cache_dir / RESULT_FILE
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(result.to_json())
    os.replace(tmp, out)
    print(f"compute ({result.compute_source}): t_c = {result.t_c * 1e9:.1f} ns/token/layer")
    print(f"pipeline overhead: t_o = {result.t_o * 1e6:.1f} us/layer")
    for name, tier in result.tiers.items():
        print(
            f"{name:>5}: t_i = {tier.t_i * 1e9:8.1f} ns/token/layer  balance r = "
            f"{tier.balance_r:.3f}  chosen r = {tier.r:.3f}  "
            f"modelled TTFT = {tier.modelled_ttft_s * 1e3:.2f} ms ({tier.probes} probes)"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
