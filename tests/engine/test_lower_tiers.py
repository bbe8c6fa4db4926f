"""LowerTiers: pre-RoPE chunk records in a real host + disk TieredStore (no SGLang)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter

from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig, WriteBackStats
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.helpers import hold_disk_writes
from tests.support.fakes import ChunkData, chunk_data

LAYERS, HEADS, DIM, SEG = 3, 2, 8, 4
INV_FREQ = default_inv_freq(DIM, 10000.0)
FP = ModelFingerprint(model_id="test-model", dtype="float32", pre_rope=True)
SEG_BYTES = 2 * LAYERS * SEG * HEADS * DIM * 4  # one full segment's K and V


def make_store(root: Path, host_bytes: int = 1 << 22, disk_bytes: int = 1 << 22) -> TieredStore:
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=host_bytes, pin_memory=False),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=disk_bytes),
    )
    return TieredStore(cfg, FP.digest())


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[TieredStore]]:
    made: list[TieredStore] = []
    yield made
    for s in made:
        s.close()


def tiers(stores: list[TieredStore], root: Path, **kw: int) -> LowerTiers:
    store = make_store(root, **kw)
    stores.append(store)
    return LowerTiers(store, FP, SEG, INV_FREQ)


def chunk(seed: int = 0, n: int = 10) -> ChunkData:
    return chunk_data(seed, n, LAYERS, HEADS, DIM, INV_FREQ)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_put_chunk_then_match_in_host(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path)
    c = chunk()
    assert lt.match(c.tokens) is None
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 3  # segments of 4, 4, 2
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 0  # all held already
    lt.store.flush()  # a disk write finishing mid-test would move the counts below
    before = lt.store.tier_stats()
    hit = lt.match(c.tokens)
    assert hit is not None and hit.tier == "host"
    assert hit.keys == lt.keys(c.tokens)
    assert hit.ranking is not None and torch.equal(hit.ranking, c.ranking)
    assert lt.store.tier_stats() == before  # match moves no KV and counts nothing
    # The records hold the keys before RoPE, each segment its own slice.
    for k in hit.keys:
        rec = lt.store.get(k.digest, c.tokens[k.start : k.end])
        assert rec is not None and rec.model_digest == FP.digest()
        close(rec.k, c.pre_k[:, k.start : k.end])
        assert torch.equal(rec.v, c.v[:, k.start : k.end])


def test_load_full_round_trips_post_rope_kv(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path)
    c = chunk(seed=3, n=11)
    lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    hit = lt.match(c.tokens)
    assert hit is not None
    kv = lt.load_full(hit, c.tokens)
    assert kv is not None and kv.shape == c.kv.shape
    close(kv, c.kv)
    assert torch.equal(kv[:, 1], c.kv[:, 1])


def test_match_on_other_tokens_misses(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path)
    c = chunk()
    lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    assert lt.match(chunk(seed=9).tokens) is None
    for i in (0, 5, 9):  # one token changed in the first, middle or last segment
        other = list(c.tokens)
        other[i] += 1
        assert lt.match(other) is None
    assert lt.match(c.tokens[:9]) is None  # last segment of another length
    assert lt.match(c.tokens + [1]) is None
    prefix = lt.match(c.tokens[:8])  # segment-aligned prefix: the same two records
    assert prefix is not None and prefix.keys == lt.keys(c.tokens)[:2]


def test_ranking_is_none_when_stored_without_one(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path)
    c = chunk()
    lt.put_chunk(c.tokens, c.pre_k, c.v, None)
    hit = lt.match(c.tokens)
    assert hit is not None and hit.ranking is None


def test_refuses_a_store_for_another_fingerprint(stores, tmp_path) -> None:
    other = ModelFingerprint(model_id="other-model", dtype="float32", pre_rope=True)
    store = TieredStore(
        TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=1 << 20, pin_memory=False),
            disk=DiskStoreConfig(root=str(tmp_path / "other"), capacity_bytes=1 << 20),
        ),
        other.digest(),
    )
    stores.append(store)
    with pytest.raises(ValueError, match="another model fingerprint"):
        LowerTiers(store, FP, SEG, INV_FREQ)
    post_rope = ModelFingerprint(model_id="test-model", dtype="float32")
    mine = make_store(tmp_path / "mine")
    stores.append(mine)
    with pytest.raises(ValueError, match="pre_rope"):
        LowerTiers(mine, post_rope, SEG, INV_FREQ)


def test_disk_only_match_reads_the_header(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path, host_bytes=0)
    c = chunk(seed=5, n=10)
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 3
    keys = lt.keys(c.tokens)
    assert [lt.store.locate(k.digest) for k in keys] == ["disk"] * 3
    before = lt.store.tier_stats()["disk"]
    hit = lt.match(c.tokens)
    assert hit is not None and hit.tier == "disk"
    assert hit.ranking is not None and torch.equal(hit.ranking, c.ranking)
    after = lt.store.tier_stats()["disk"]
    assert after.hits == before.hits and after.bytes_read == before.bytes_read == 0
    kv = lt.load_full(hit, c.tokens)
    assert kv is not None
    close(kv, c.kv)


def test_mixed_tiers_report_the_slowest(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path, host_bytes=SEG_BYTES)  # room for one segment in memory
    c = chunk(seed=6, n=8)
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 2
    lt.store.flush()  # write-through to disk
    first, second = lt.keys(c.tokens)
    assert lt.store.locate(first.digest) == "disk" and lt.store.locate(second.digest) == "host"
    hit = lt.match(c.tokens)
    assert hit is not None and hit.tier == "disk"
    assert hit.ranking is not None and torch.equal(hit.ranking, c.ranking)
    kv = lt.load_full(hit, c.tokens)
    assert kv is not None
    close(kv, c.kv)


def test_a_dropped_segment_makes_the_chunk_miss(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path, disk_bytes=0)  # nothing reaches the disk
    c = chunk()
    lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    lt.store.flush()
    hit = lt.match(c.tokens)
    assert hit is not None
    lt.store.evict(1 << 30)
    assert lt.match(c.tokens) is None
    assert lt.load_full(hit, c.tokens) is None


def test_placements_split_the_recomputed_set_by_segment(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path)
    c = chunk(n=10)
    lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    hit = lt.match(c.tokens)
    assert hit is not None
    recompute = torch.tensor([0, 3, 4, 5, 6, 7, 9])
    places = lt.placements(hit, c.tokens, 20, recompute)
    assert [p.key for p in places] == [k.digest for k in hit.keys]
    assert [p.offset for p in places] == [20, 24, 28]
    assert [p.num_tokens for p in places] == [4, 4, 2]
    assert [p.recompute.tolist() for p in places] == [[0, 3], [0, 1, 2, 3], [1]]
    assert [p.reuse.tolist() for p in places] == [[1, 2], [], [0]]
    assert [list(p.token_ids or ()) for p in places] == [
        c.tokens[0:4],
        c.tokens[4:8],
        c.tokens[8:10],
    ]


class FakeMetrics:
    """The lifecycle series of ``PicMetrics``, same names and labels, in a private
    registry (the real class registers globally, once per process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queue_drops = Counter(
            "sgl_pic_queue_drops", "drops", ["queue"], registry=self.registry
        )
        self.shutdown_writes = Counter(
            "sgl_pic_shutdown_writes", "shutdown", ["outcome"], registry=self.registry
        )

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"{name}_total", labels) or 0.0


def test_queue_drops_reach_the_metrics_as_deltas(stores, tmp_path, monkeypatch) -> None:
    held = hold_disk_writes(monkeypatch)
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False, write_back_queue=1),
        disk=DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 22),
    )
    store = TieredStore(cfg, FP.digest())
    stores.append(store)
    lt = LowerTiers(store, FP, SEG, INV_FREQ)
    metrics = FakeMetrics()
    try:
        # The writer must hold its first job before the rest arrive; otherwise how many
        # are refused depends on when its thread dequeues.
        first = chunk(seed=2, n=4)
        assert lt.put_chunk(first.tokens, first.pre_k, first.v, first.ranking) == 1
        assert held.started.wait(10)
        c = chunk(n=40)  # 10 segments: one waits in the queue, the rest are refused
        assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 10  # all in host memory
        dropped = store.queue_stats()["writeback"].dropped
        assert dropped == 9
        assert lt.export_stats(metrics) == {"writeback": dropped}
        assert metrics.value("sgl_pic_queue_drops", queue="writeback") == dropped
        assert lt.export_stats(metrics) == {}  # nothing new: nothing added
        c2 = chunk(seed=1, n=8)
        lt.put_chunk(c2.tokens, c2.pre_k, c2.v, c2.ranking)
        assert lt.export_stats(metrics) == {"writeback": 2}
        assert metrics.value("sgl_pic_queue_drops", queue="writeback") == dropped + 2
        # Promotion drops go under their own label.
        real_stats = store.queue_stats

        def with_promotions() -> dict[str, WriteBackStats]:
            return {**real_stats(), "tier_promotion": WriteBackStats(5, 2, 0, 3)}

        monkeypatch.setattr(store, "queue_stats", with_promotions)
        assert lt.export_stats(metrics) == {"tier_promotion": 3}
        assert metrics.value("sgl_pic_queue_drops", queue="tier_promotion") == 3
        assert metrics.value("sgl_pic_queue_drops", queue="writeback") == dropped + 2
    finally:
        held.release.set()


def test_a_chunk_encoded_after_a_context_is_found_with_that_context_only(stores, tmp_path) -> None:
    lt = tiers(stores, tmp_path)
    c, context = chunk(), "c" * 64
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking, "", context) == 3
    assert lt.match(c.tokens) is None and lt.match(c.tokens, "", "d" * 64) is None
    hit = lt.match(c.tokens, "", context)
    assert hit is not None and hit.context == context
    assert hit.keys == lt.keys(c.tokens, "", context)
    kv = lt.load_full(hit, c.tokens)
    assert kv is not None
    close(kv, c.kv)
    # Encoded alone, the same tokens are another record.
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 3


def test_rekey_hides_records_of_the_old_weights(stores, tmp_path) -> None:
    """After a weight update, no record stored under the old weights is found, in host
    memory or on disk; records put afterwards are found under the new key only."""
    import dataclasses

    lt = tiers(stores, tmp_path)
    c = chunk()
    lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    lt.store.flush()
    assert lt.match(c.tokens) is not None
    with pytest.raises(ValueError, match="pre-RoPE"):
        lt.rekey(dataclasses.replace(FP, model_id="updated", pre_rope=False))
    lt.rekey(dataclasses.replace(FP, model_id="updated"))
    assert lt.match(c.tokens) is None
    assert lt.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 3
    assert lt.match(c.tokens) is not None
    lt.rekey(FP)  # back to the launch weights: their records are still there
    hit = lt.match(c.tokens)
    assert hit is not None and hit.keys == lt.keys(c.tokens)
