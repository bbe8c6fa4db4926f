"""TieredStore with a shared tier below host and disk (a real Mooncake store)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.shared.service import SharedStoreService
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from sgl_pic.store.store_link import LinkConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.helpers import MODEL, OTHER_MODEL, make_record, same_record
from tests.store.shared_helpers import start_service


@pytest.fixture(scope="module")
def service() -> Iterator[SharedStoreService]:
    svc = start_service()
    yield svc
    svc.stop()


def tiered(root: Path, url: str, model: str = MODEL) -> TieredStore:
    shared = SharedStore(SharedStoreConfig(url, link=LinkConfig(retry_s=0.5)), model)
    assert shared.link.wait_connected(15)
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 22),
    )
    return TieredStore(cfg, model, shared=shared)


def test_lookup_order_promotion_and_stats(tmp_path: Path, service: SharedStoreService) -> None:
    a, b = tiered(tmp_path / "a", service.url), tiered(tmp_path / "b", service.url)
    try:
        rec = make_record(seed=31)
        assert a.put(rec)
        a.flush()
        assert a.locate(rec.key) == "host"  # local tiers first
        assert a.disk.contains(rec.key)
        assert b.locate(rec.key) == "shared"
        assert not b.contains(rec.key)  # local tiers only: no network call
        assert b.peek_ranking(rec.key, rec.token_ids) is not None
        assert b.get_layers(rec.key, range(0, 1), [0, 1], rec.token_ids) is not None
        b.flush()
        assert b.locate(rec.key) == "host"  # promoted
        got = b.get(rec.key, rec.token_ids)
        assert got is not None and same_record(got, rec)
        assert set(b.tier_stats()) == {"host", "disk", "shared"}
        assert b.tier_stats()["shared"].hits == 2  # the layer read and the promotion
        assert "shared_write" in b.queue_stats()
        report = b.shutdown(1.0)
        assert report.shared_dropped == 0 and report.joined
    finally:
        a.close()
        b.close()


def test_shared_errors_are_reported_apart(tmp_path: Path, service: SharedStoreService) -> None:
    store = tiered(tmp_path, service.url)
    try:
        assert not store.shared.put(make_record(seed=32, model=OTHER_MODEL))  # type: ignore[union-attr]
        assert store.stats().errors == {"shared_foreign_model": 1}
    finally:
        store.close()


def test_a_shared_tier_of_another_model_is_refused(
    tmp_path: Path, service: SharedStoreService
) -> None:
    shared = SharedStore(SharedStoreConfig(service.url), OTHER_MODEL)
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 20, pin_memory=False),
        disk=DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 20),
    )
    try:
        with pytest.raises(ValueError, match="another model"):
            TieredStore(cfg, MODEL, shared=shared)
    finally:
        shared.close()


def test_writes_skipped_during_an_outage_are_backfilled(tmp_path: Path) -> None:
    svc = start_service()
    a = tiered(tmp_path / "a", svc.url)
    b = None
    try:
        assert a.shared is not None
        svc.kill()
        a.shared.headers.clear()  # force a round trip to the dead store
        assert a.shared.get(make_record(seed=40).key) is None  # finds it down
        assert not a.shared.link_stats().up
        recs = [make_record(seed=41 + i) for i in range(3)]
        for rec in recs:
            assert a.put(rec)  # kept locally; the shared write is skipped
        a.flush()
        assert a.shared.write_counts()["skipped"] == 3
        svc.start()
        deadline = time.monotonic() + 30
        while a.shared.write_counts()["backfilled"] < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # the link's probe finds the store back and queues the backfill
        assert a.shared.write_counts()["backfilled"] == 3
        b = tiered(tmp_path / "b", svc.url)
        for rec in recs:
            assert b.locate(rec.key) == "shared"
            got = b.get(rec.key, rec.token_ids)
            assert got is not None and same_record(got, rec)
        # The backfill read the local copies without counting them as hits.
        assert a.tier_stats()["host"].hits == 0 and a.tier_stats()["disk"].hits == 0
    finally:
        a.close()
        if b is not None:
            b.close()
        svc.stop()
