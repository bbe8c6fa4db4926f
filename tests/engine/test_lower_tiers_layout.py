"""Lower-tier records whose KV layout is not the serving pool's, and disk reads failing with
an I/O error.

A record under a valid key and this model's fingerprint, with a sound file (valid header
and payload checksums), may still hold another layout: fewer or more layers, another
layer_start, KV-head count, head dim or dtype (planted, or a bug). Such a record must never
reach the pool: it is counted ("layout_mismatch"), dropped (file / object removed, so the
key is free again) and the chunk is a miss, recomputed and stored afresh.

The stores are built as the server builds them (``tier_setup.lower_tiers_of`` with the layout
of its KV pool, ``tier_setup.record_layout``).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl_pic.binding import tier_setup
from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.config import PicConfig
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.layer_feed import LayerFeed, MissingChunkError, feed_every_layer
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.base import ChunkKV
from sgl_pic.store.disk import store as disk_mod
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.format import encode_record, write_record
from sgl_pic.store.object_backend import ObjectBackend, PutOutcome
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from tests.support.fakes import SENTINEL, FakePool, chunk_data

LAYERS, HEADS, DIM, N = 3, 2, 8, 6
INV_FREQ = default_inv_freq(DIM, 10000.0)
ROPE = ModelRope.plain(INV_FREQ, max_positions=64)
FP = ModelFingerprint(model_id="m", dtype="float32")
TOKENS = list(range(100, 100 + N))

# name -> (layers, kv heads, head dim, dtype, layer_start)
BAD = {
    "fewer_layers": (LAYERS - 1, HEADS, DIM, torch.float32, 0),
    "more_layers": (LAYERS + 1, HEADS, DIM, torch.float32, 0),
    "layer_start_1": (LAYERS, HEADS, DIM, torch.float32, 1),
    "one_kv_head": (LAYERS, 1, DIM, torch.float32, 0),
    "more_kv_heads": (LAYERS, 4, DIM, torch.float32, 0),
    "smaller_head_dim": (LAYERS, HEADS, DIM // 2, torch.float32, 0),
    "larger_head_dim": (LAYERS, HEADS, DIM * 2, torch.float32, 0),
    "float16": (LAYERS, HEADS, DIM, torch.float16, 0),
    "bfloat16": (LAYERS, HEADS, DIM, torch.bfloat16, 0),
}


def kv_access() -> tuple[FakePool, KVAccess]:
    pool = FakePool(64, LAYERS, HEADS, DIM)
    return pool, KVAccess(pool, LAYERS, ROPE)


def lower_tiers(root: Path, host_mb: int = 0):  # noqa: ANN201
    """Host + disk tiers as ``plugin.build_tree_cache`` makes them for this pool."""
    settings = PicServerSettings(
        PicConfig(), host_cache_mb=host_mb, disk_cache_dir=str(root), disk_cache_mb=64
    )
    return tier_setup.lower_tiers_of(
        settings, FP, ROPE.spec, tier_setup.record_layout(kv_access()[1])
    )


def bad_record(key: str, digest: str, spec: tuple) -> ChunkKV:
    layers, heads, dim, dtype, start = spec
    g = torch.Generator().manual_seed(1)
    shape = (layers, N, heads, dim)
    k = (torch.randn(shape, generator=g) + 50).to(dtype)  # far from anything real
    v = (torch.randn(shape, generator=g) + 50).to(dtype)
    return ChunkKV(key, digest, tuple(TOKENS), k, v, torch.rand(N, generator=g), start)


def plant(root: Path, spec: tuple) -> tuple[str, Path]:
    """A sound file of layout ``spec`` under the chunk's own key and digest, before start."""
    probe = lower_tiers(root)
    try:
        (key,) = probe.keys(TOKENS)
        path = probe.store.disk.path_of(key.digest)
        digest = probe.model_digest
    finally:
        probe.store.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_record(path, bad_record(key.digest, digest, spec))
    return key.digest, path


def errors(lower) -> dict[str, int]:  # noqa: ANN001
    return dict(lower.store.stats().errors)


def feed_all(lower, hit, pool_kv: KVAccess, mode: str = "inorder") -> None:  # noqa: ANN001
    places = lower.placements(hit, TOKENS, 0, torch.empty(0, dtype=torch.int64))
    feed = LayerFeed(lower.loader, places, torch.arange(1, 1 + N), pool_kv, LAYERS, mode)
    feed_every_layer(feed)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_planted_file_of_another_layout_is_dropped_and_recomputed(tmp_path, name) -> None:
    key, path = plant(tmp_path, BAD[name])
    lower = lower_tiers(tmp_path)
    try:
        # A miss: the scheduler recomputes the chunk (phase 1) ...
        assert lower.match(TOKENS) is None
        assert errors(lower).get("layout_mismatch", 0) == 1
        assert not path.exists() and not lower.store.contains(key)
        # ... and stores it afresh under the freed key; that copy is then served.
        c = chunk_data(3, N, LAYERS, HEADS, DIM, INV_FREQ)
        assert lower.put_chunk(TOKENS, c.pre_k, c.v, c.ranking) == 1
        lower.store.flush()
        hit = lower.match(TOKENS)
        assert hit is not None
        pool, kv = kv_access()
        feed_all(lower, hit, kv)
        k, v = pool.snapshot()
        torch.testing.assert_close(v[:, 1 : 1 + N], c.v)
        full = lower.load_full(hit, TOKENS)
        assert full is not None and full.shape == (LAYERS, 2, N, HEADS, DIM)
    finally:
        lower.store.close()


@pytest.mark.parametrize("name", ["one_kv_head", "more_layers", "float16", "fewer_layers"])
@pytest.mark.parametrize("mode", ["inorder", "threaded"])
def test_a_file_replaced_after_the_lookup_never_reaches_the_pool(tmp_path, name, mode) -> None:
    """Matched while sound, replaced before the load: the feed reports the chunk missing
    (the executor's retry, where it misses and is recomputed) and writes none of it."""
    lower = lower_tiers(tmp_path)
    try:
        c = chunk_data(3, N, LAYERS, HEADS, DIM, INV_FREQ)
        lower.put_chunk(TOKENS, c.pre_k, c.v, c.ranking)
        lower.store.flush()
        hit = lower.match(TOKENS)
        assert hit is not None and hit.tier == "disk"
        (key,) = hit.keys
        path = lower.store.disk.path_of(key.digest)
        write_record(path, bad_record(key.digest, lower.model_digest, BAD[name]))
        pool, kv = kv_access()
        with pytest.raises(MissingChunkError):
            feed_all(lower, hit, kv, mode)
        k, v = pool.snapshot()
        assert bool((k == SENTINEL).all()) and bool((v == SENTINEL).all())
        assert lower.load_full(hit, TOKENS) is None
        assert errors(lower).get("layout_mismatch", 0) == 1
        assert not path.exists() and lower.match(TOKENS) is None
    finally:
        lower.store.close()


class MemoryBackend(ObjectBackend):
    """An in-process object store."""

    scheme = "mooncake"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def connect(self) -> None:
        pass

    def size(self, key: str) -> int | None:
        return len(self.objects[key]) if key in self.objects else None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def put_if_absent(self, key: str, parts) -> PutOutcome:  # noqa: ANN001
        if key in self.objects:
            return PutOutcome.PRESENT
        self.objects[key] = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        return PutOutcome.STORED

    def read_ranges(self, key: str, ranges) -> np.ndarray | None:  # noqa: ANN001
        data = self.objects.get(key)
        if data is None:
            return None
        return np.frombuffer(b"".join(data[o : o + n] for o, n in ranges), dtype=np.uint8)

    def remove(self, key: str) -> None:
        self.objects.pop(key, None)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("name", ["one_kv_head", "fewer_layers", "bfloat16"])
def test_the_shared_tier_drops_an_object_of_another_layout(tmp_path, name) -> None:
    probe = lower_tiers(tmp_path)
    (key,) = probe.keys(TOKENS)
    digest = probe.model_digest
    layout = probe.store.layout
    probe.store.close()
    backend = MemoryBackend()
    enc = encode_record(bad_record(key.digest, digest, BAD[name]))
    backend.objects[key.digest] = enc.head + b"".join(a.tobytes() for a in enc.areas)
    shared = SharedStore(
        SharedStoreConfig("mooncake://127.0.0.1:1"), digest, backend, layout=layout
    )
    try:
        deadline = time.monotonic() + 10
        while not shared.link_stats().up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.link_stats().up
        assert shared.peek_ranking(key.digest, TOKENS) is False
        assert shared.get_layers(key.digest, range(0, 1), None, TOKENS) is None
        assert dict(shared.stats().errors).get("layout_mismatch", 0) == 1
        assert key.digest not in backend.objects
    finally:
        shared.close()


def test_a_disk_read_failing_with_eio_leaves_no_unaccounted_file(tmp_path, monkeypatch) -> None:
    """The entry is dropped on an I/O error; its file must go too, or it holds disk space
    that no accounting sees and no eviction frees, until a restart."""
    digest = FP.digest()

    def rec(i: int) -> ChunkKV:
        k = torch.full((2, 8, 2, 4), float(i))
        return ChunkKV(f"{i:064x}", digest, tuple(range(8)), k, k.clone())

    size = encode_record(rec(0)).size
    store = DiskStore(DiskStoreConfig(str(tmp_path), 3 * size), digest)
    for i in range(3):
        assert store.put(rec(i))

    def eio(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_mod, "RecordFile", eio)
    assert store.get(rec(0).key) is None
    monkeypatch.undo()
    assert store.stats().errors["unreadable"] == 1

    def on_disk() -> int:
        return sum(p.stat().st_size for p in tmp_path.glob("*/*.sglkv"))

    assert on_disk() == store.stats().bytes_used
    for i in range(3, 6):
        assert store.put(rec(i))
    assert on_disk() <= store.stats().capacity_bytes
    store.evict(1 << 40)
    assert on_disk() == 0
