"""Calibrate CacheTune's recompute ratio r per storage tier (Section 4.3, Appendix C).

Measures t_c (recompute, per token per layer), t_i (load, per token per layer, per
tier) and t_o (fixed per-layer pipeline overhead), then picks r by warm-started
golden-section search, either over the cost model or over measured pipeline runs.

Loads are timed on the code the server runs: a chunk is written through ``LowerTiers``
(segments, pre-RoPE fingerprint) into a ``TieredStore`` holding it in host memory only or
on disk only, and read back by a ``LayerFeed`` over the server's placements and loader,
which rotates the rows and writes them into a scratch pool. The compute cost is a
callable, so the engine can supply its real layer forward; the CLI has no engine and uses
a PROXY, the dense matmuls of one SmolLM2-135M decoder layer in torch (no attention, no
norms, no real weights), on KV of the embedded model's shape (30 layers, 3 KV heads,
head dim 64, float32).

The parts: timing (``calibrate_timing``), the model's shape and the compute proxy
(``calibrate_proxy``), the tier chunks and feeds the loads are timed on
(``calibrate_tiers``); this module runs them and writes the result.

    python -m sgl_pic.cli.calibrate [--cache-dir DIR] [--tokens 512] [--objective model]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_pic.cli.calibrate_proxy import MatmulProxy, ModelShape
from sgl_pic.cli.calibrate_tiers import (
    measure_overhead,
    pipeline_objective,
    tier_chunks,
    tier_loader,
)
from sgl_pic.cli.calibrate_timing import device_sync, per_token_cost
from sgl_pic.cli.calibrate_timing import time_call as time_call
from sgl_pic.config import PicConfig
from sgl_pic.paths import cache_root
from sgl_pic.store.cost_model import (
    CostParams,
    SearchConfig,
    SearchResult,
    balance_ratio,
    choose_ratio,
    ttft,
)

RESULT_FILE = "calibration.json"


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
    segment_tokens: int = PicConfig().segment_tokens,
    device: str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
) -> CalibrationResult:
    """Measure t_c, t_o and per-tier t_i, and choose r per tier. ``compute(n)`` runs one
    layer's recompute of n tokens; None uses ``MatmulProxy`` (a proxy) on ``device`` in
    ``compute_dtype``. Loads run the server's ``LayerFeed`` into a scratch pool on
    ``device``, over chunks cut into ``segment_tokens`` segments like the server's. Every
    timing waits for ``device`` (``device_sync``)."""
    if objective not in ("model", "measured"):
        raise ValueError(f"objective must be 'model' or 'measured', got {objective!r}")
    compute_fn = (
        compute if compute is not None else MatmulProxy(shape, device=device, dtype=compute_dtype)
    )
    sync = device_sync(device)
    small, large = max(1, num_tokens // 8), num_tokens
    t_c = per_token_cost(compute_fn, small, large, repeats, sync)
    t_o = measure_overhead(shape.num_layers, repeats)
    tiers: dict[str, TierCalibration] = {}
    with tier_chunks(cache_dir, shape, num_tokens, segment_tokens, device) as chunks:
        for name, (chunk, cold) in chunks.items():
            t_i = (
                per_token_cost(tier_loader(chunk, cold), small, large, repeats, sync)
                / shape.num_layers
            )
            params = CostParams(t_c, t_i, t_o, shape.num_layers, num_tokens)
            obj = (
                None
                if objective == "model"
                else pipeline_objective(chunk, compute_fn, cold=cold, sync=sync)
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
    parser = argparse.ArgumentParser(prog="python -m sgl_pic.cli.calibrate", description=__doc__)
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
