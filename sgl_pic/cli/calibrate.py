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

    python -m sgl_pic.cli.calibrate [--cache-dir DIR] [--tokens 512] [--objective model]
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_pic.binding.model_rope import ModelRope
from sgl_pic.config import PicConfig
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.layer_feed import LayerFeed, feed_every_layer
from sgl_pic.engine.lower_tiers import LowerHit, LowerTiers
from sgl_pic.keys import ModelFingerprint
from sgl_pic.paths import cache_root
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.cost_model import (
    CostParams,
    SearchConfig,
    SearchResult,
    balance_ratio,
    choose_ratio,
    ttft,
)
from sgl_pic.store.disk import DiskStoreConfig
from sgl_pic.store.host import HostStore, HostStoreConfig
from sgl_pic.store.loader import LoaderConfig, SparseLoader
from sgl_pic.store.tiered import Tier, TieredStore, TieredStoreConfig

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


def _no_sync() -> None:
    return None


def device_sync(device: str | torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work: CUDA kernels run asynchronously, so a
    timer that did not wait would time their launch, not their run."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return _no_sync


def time_call(
    fn: Callable[[], object],
    repeats: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] = _no_sync,
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
    sync: Callable[[], None] = _no_sync,
) -> float:
    """Seconds per token of ``run(n)``, as the slope between n = small and n = large, so
    a fixed per-call cost (launch, file open) does not inflate the per-token rate."""
    if not 0 < small < large:
        raise ValueError(f"need 0 < small < large, got {small}, {large}")
    t_small = time_call(lambda: run(small), repeats, sync=sync)
    t_large = time_call(lambda: run(large), repeats, sync=sync)
    return max(0.0, (t_large - t_small) / (large - small))


def measure_overhead(num_layers: int, repeats: int = 5) -> float:
    """t_o: seconds per layer the server's threaded ``LayerFeed`` spends on its own
    handoffs (a feed with nothing to load, consumed layer by layer)."""
    store = HostStore(HostStoreConfig(capacity_bytes=0), hashlib.sha256(b"t_o").hexdigest())
    loader = SparseLoader(store, default_inv_freq(2, 10000.0), LoaderConfig())
    pool = ScratchPool(1, num_layers, 1, 2, torch.float32)
    kv = KVAccess(pool, num_layers, ModelRope.plain(loader.inv_freq, max_positions=1))
    empty = torch.empty(0, dtype=torch.int64)  # host: no slots, nothing is written

    def run() -> None:
        feed_every_layer(LayerFeed(loader, [], empty, kv, num_layers, mode="threaded"))

    return time_call(run, repeats) / num_layers


class ScratchPool:
    """A token pool of per-layer K and V buffers # [size, num_kv_heads, head_dim], exposed
    like SGLang's (``get_key_buffer`` / ``get_value_buffer``), for feeds to write into."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
    ) -> None:
        shape = (size, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[layer]


class MatmulProxy:
    """A PROXY for one decoder layer's recompute cost: the q/k/v/o projections and the
    gated MLP of the model's shape as plain matmuls on random weights. It ignores
    attention over the context, norms and the real kernels; the engine should pass its
    real layer forward instead."""

    def __init__(
        self,
        shape: ModelShape,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        h, d = shape.hidden, shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
        self.device, self.dtype = torch.device(device), dtype

        def w(*s: int) -> torch.Tensor:
            return (torch.randn(*s, generator=g) / math.sqrt(s[0])).to(device, dtype)

        self.w_qkv = w(h, qkv)  # [hidden, (heads + 2 kv_heads) * head_dim]
        self.w_o = w(shape.num_heads * d, h)  # [heads * head_dim, hidden]
        self.w_gu = w(h, 2 * shape.intermediate)  # [hidden, 2 * intermediate]
        self.w_down = w(shape.intermediate, h)  # [intermediate, hidden]
        self.q_width = shape.num_heads * d
        self.hidden = h

    def __call__(self, num_tokens: int) -> torch.Tensor:
        """# [num_tokens, hidden] output for random inputs of ``num_tokens`` tokens."""
        x = torch.randn(num_tokens, self.hidden, device=self.device, dtype=self.dtype)
        q = (x @ self.w_qkv)[:, : self.q_width]
        x = x + q @ self.w_o
        gate, up = (x @ self.w_gu).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ self.w_down


class TierChunk:
    """One calibration chunk held by one tier, as the server holds lower-tier chunks.

    The chunk (random pre-RoPE KV of the model's shape) is written through ``LowerTiers``
    into a ``TieredStore`` that keeps it in host memory only ("host") or on disk only
    ("disk"); ``feed`` builds the server's ``LayerFeed`` over it. Close it when done.
    """

    def __init__(
        self,
        tier: Tier,
        root: Path,
        shape: ModelShape,
        num_tokens: int,
        segment_tokens: int,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        dtype = getattr(torch, shape.dtype)
        row = shape.num_kv_heads * shape.head_dim * dtype.itemsize
        room = 4 * 2 * shape.num_layers * num_tokens * row + (1 << 20)  # K, V and headers
        host = HostStoreConfig(room if tier == "host" else 0, write_back="on_evict")
        disk = DiskStoreConfig(str(root), room if tier == "disk" else 0)
        self.fingerprint = ModelFingerprint(
            model_id=hashlib.sha256(f"calibrate:{shape}".encode()).hexdigest(),
            dtype=shape.dtype,
            pre_rope=True,
        )
        config = TieredStoreConfig(host, disk, promote_on_get=False, promote_on_get_layers=False)
        self.store = TieredStore(config, self.fingerprint.digest())
        self.inv_freq = default_inv_freq(shape.head_dim, shape.rope_theta)
        self.lower = LowerTiers(
            self.store, self.fingerprint, segment_tokens, self.inv_freq, device=device
        )
        self.shape = shape
        self.num_tokens = num_tokens
        self.token_ids = list(range(num_tokens))
        g = torch.Generator().manual_seed(seed)
        dims = (shape.num_layers, num_tokens, shape.num_kv_heads, shape.head_dim)
        k = torch.randn(dims, generator=g).to(dtype)
        v = torch.randn(dims, generator=g).to(dtype)
        self.lower.put_chunk(self.token_ids, k, v, torch.rand(num_tokens, generator=g))
        self.store.flush()
        hit = self.lower.match(self.token_ids)
        if hit is None or hit.tier != tier:
            where = None if hit is None else hit.tier
            raise OSError(f"the calibration chunk landed in {where}, not in {tier} (under {root})")
        self.hit: LowerHit = hit
        self.pool = ScratchPool(
            num_tokens, shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, device
        )
        # The feed writes rows already rotated by the loader: the table is never read.
        rope = ModelRope.plain(self.inv_freq, max_positions=1)
        self.kv = KVAccess(self.pool, shape.num_layers, rope)
        self.slots = torch.arange(num_tokens, device=device)

    def feed(self, recompute: torch.Tensor, mode: str) -> LayerFeed:
        """The server's feed of this chunk at offset 0, loading all but ``recompute``
        (# [k] int64 chunk-local indices)."""
        placements = self.lower.placements(self.hit, self.token_ids, 0, recompute)
        return LayerFeed(
            self.lower.loader, placements, self.slots, self.kv, self.shape.num_layers, mode
        )

    def files(self) -> list[Path]:
        """The chunk's files on disk (none for the host tier)."""
        disk = self.store.disk
        return [disk.path_of(k.digest) for k in self.hit.keys if disk.contains(k.digest)]

    def close(self) -> None:
        self.store.close()


def _drop_page_cache(path: Path) -> None:
    # Best effort cold read: drop this file's clean pages (no root needed on Linux).
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_feed(feed: LayerFeed, per_layer: Callable[[int], object] | None = None) -> None:
    feed.start()
    try:
        for layer in range(feed.num_layers):
            feed.before_layer(layer)
            if per_layer is not None:
                per_layer(layer)
    finally:
        feed.close()


def tier_loader(
    chunk: TierChunk, cold: Callable[[], None] | None = None
) -> Callable[[int], object]:
    """``run(n)``: the server's load of n tokens of ``chunk`` through every layer (an
    in-order ``LayerFeed``: sparse fetch, deferred RoPE, write into the pool); the caller
    divides the slope by the layer count. One layer alone is too short to time against
    a file open and the timer's noise."""
    n_all = chunk.num_tokens

    def run(n: int) -> object:
        if cold is not None:
            cold()
        # The first n_all - n tokens are "recomputed", so exactly n are loaded.
        feed = chunk.feed(torch.arange(0, n_all - n), "inorder")
        _run_feed(feed)
        return feed.bytes_moved

    return run


def pipeline_objective(
    chunk: TierChunk,
    compute: Callable[[int], object],
    repeats: int = 3,
    cold: Callable[[], None] | None = None,
    sync: Callable[[], None] = _no_sync,
) -> Callable[[float], float]:
    """Measured TTFT(r): the server's threaded ``LayerFeed`` over all layers, loading the
    reuse complement of a random recompute set of ceil(r N) tokens while ``compute``
    recomputes those, layer after layer (the worker prefetches layer l + 1 meanwhile)."""
    n = chunk.num_tokens

    def measure(r: float) -> float:
        k = min(n, math.ceil(r * n))
        recompute = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k]

        def run() -> None:
            if cold is not None:
                cold()
            _run_feed(chunk.feed(recompute, "threaded"), lambda layer: compute(k))

        return time_call(run, repeats, sync=sync)

    return measure


@contextmanager
def tier_chunks(
    cache_dir: Path,
    shape: ModelShape,
    num_tokens: int,
    segment_tokens: int,
    device: str = "cpu",
) -> Iterator[dict[str, tuple[TierChunk, Callable[[], None] | None]]]:
    """The "host" and "disk" calibration chunks, each with its cold-read hook (the disk
    one drops its files' page cache), in a scratch directory under ``cache_dir`` that is
    removed afterwards."""
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix="calib-disk-") as tmp:
        chunks: dict[str, tuple[TierChunk, Callable[[], None] | None]] = {}
        try:
            for tier in ("host", "disk"):
                chunk = TierChunk(tier, Path(tmp) / tier, shape, num_tokens, segment_tokens, device)
                files = chunk.files()
                cold = (lambda files=files: [_drop_page_cache(f) for f in files]) if files else None
                chunks[tier] = (chunk, cold)
            yield chunks
        finally:
            for chunk, _ in chunks.values():
                chunk.close()


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
