"""Two servers' lower tiers over one real shared store (no SGLang): a chunk one computed is
a hit on the other, loaded sparsely and promoted to its host memory, and the metrics say
it came from the shared tier."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.shared.service import SharedStoreService
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from sgl_pic.store.store_link import LinkConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.shared_helpers import start_service
from tests.support.fakes import chunk_data

LAYERS, HEADS, DIM, SEG = 3, 2, 8, 4
INV_FREQ = default_inv_freq(DIM, 10000.0)
FP = ModelFingerprint(model_id="test-model", dtype="float32", pre_rope=True)


@pytest.fixture(scope="module")
def service() -> Iterator[SharedStoreService]:
    svc = start_service()
    yield svc
    svc.stop()


class FakeMetrics:
    """The series ``export_stats`` / ``export_shared_stats`` write, in a private registry."""

    def __init__(self) -> None:
        reg = CollectorRegistry()
        self.queue_drops = Counter("qd", "", ["queue"], registry=reg)
        self.shared_store_up = Gauge("up", "", registry=reg)
        self.shared_store_unreachable = Counter("unreach", "", registry=reg)
        self.shared_writes = Counter("sw", "", ["outcome"], registry=reg)


def server(root: Path, url: str) -> LowerTiers:
    shared = SharedStore(SharedStoreConfig(url, link=LinkConfig(retry_s=0.5)), FP.digest())
    assert shared.link.wait_connected(15)
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 22),
    )
    return LowerTiers(TieredStore(cfg, FP.digest(), shared=shared), FP, SEG, INV_FREQ)


@pytest.fixture
def pair(tmp_path: Path, service: SharedStoreService) -> Iterator[tuple[LowerTiers, LowerTiers]]:
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    yield a, b
    a.store.close()
    b.store.close()


def test_chunk_computed_on_a_hits_on_b_from_the_shared_tier(
    pair: tuple[LowerTiers, LowerTiers],
) -> None:
    a, b = pair
    c = chunk_data(1, 10, LAYERS, HEADS, DIM, INV_FREQ)
    assert b.match(c.tokens) is None
    assert a.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 3
    a.store.flush()
    hit = b.match(c.tokens)
    assert hit is not None and hit.tier == "shared"
    assert [b.store.locate(k.digest) for k in hit.keys] == ["shared"] * 3
    torch.testing.assert_close(hit.ranking, c.ranking)
    # Sparse: the loader reads one layer of the tokens not recomputed.
    recompute = torch.tensor([0, 5])
    placements = b.placements(hit, c.tokens, 0, recompute)
    got = b.loader.fetch_layer(placements, 1)
    assert got is not None
    full = b.load_full(hit, c.tokens)
    assert full is not None
    torch.testing.assert_close(full, c.kv, atol=1e-5, rtol=0)
    b.store.flush()  # promotions of the shared hits into B's host memory
    assert [b.store.locate(k.digest) for k in hit.keys] == ["host"] * 3
    m = FakeMetrics()
    b.export_stats(m)
    assert m.shared_store_up._value.get() == 1
    a.export_stats(m)
    assert m.shared_writes.labels(outcome="stored")._value.get() == 3


def test_b_writing_the_same_chunk_stores_nothing_new(pair: tuple[LowerTiers, LowerTiers]) -> None:
    a, b = pair
    c = chunk_data(2, 8, LAYERS, HEADS, DIM, INV_FREQ)
    a.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    b.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
    a.store.flush()
    b.store.flush()
    counts = [s.store.shared.write_counts() for s in (a, b)]  # type: ignore[union-attr]
    assert sum(x["stored"] for x in counts) + sum(x["present"] for x in counts) == 4
    assert sum(x["failed"] for x in counts) == 0


SPLIT_SCRIPT = """
from sgl_pic.core.metrics import PicMetrics, RequestStats
m = PicMetrics()
m.record(RequestStats(5, 0, 3, 0, 2, 30, 4, 40, 0.0, disk_hits=1, shared_hits=2))
m.record(RequestStats(5, 0, 3, 0, 2, 30, 4, 40, 0.0, disk_hits=3))
print(m.tier_hits.labels(tier="shared")._value.get(), m.tier_hits.labels(tier="disk")._value.get())
"""


def test_metrics_split_shared_hits_from_disk_hits() -> None:
    # Its own process: Prometheus names are global, and PicMetrics registers them.
    out = subprocess.run(
        [sys.executable, "-c", SPLIT_SCRIPT], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["2.0", "4.0"]
