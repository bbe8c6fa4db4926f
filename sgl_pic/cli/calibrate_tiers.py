"""Load costs measured on the code the server runs: a chunk written through
``LowerTiers`` (segments, pre-RoPE fingerprint) into a ``TieredStore`` that holds it in
host memory only or on disk only (``TierChunk``), read back by a ``LayerFeed`` over the
server's placements and loader, which rotates the rows and writes them into a scratch
pool (``ScratchPool``). Disk reads are made cold by dropping the files' page cache.
Offline only (``sgl_pic.cli.calibrate``); everything lives in a scratch directory.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from sgl_pic.cli.calibrate_proxy import ModelShape
from sgl_pic.cli.calibrate_timing import no_sync, time_call
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.layer_feed import LayerFeed, feed_every_layer
from sgl_pic.engine.lower_tiers import LowerHit, LowerTiers
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStore, HostStoreConfig
from sgl_pic.store.loader import LoaderConfig, SparseLoader
from sgl_pic.store.tiered import Tier, TieredStore, TieredStoreConfig


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
    sync: Callable[[], None] = no_sync,
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
