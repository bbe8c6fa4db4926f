import os
import threading

import pytest
import torch

from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.format import TMP_PREFIX, read_record
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.helpers import MODEL, hold_disk_writes, make_record, same_record

REC_BYTES = make_record().nbytes


def tiered(root, host_records=10, write_back="on_put", device=None) -> TieredStore:
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=host_records * REC_BYTES, write_back=write_back),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 24),
    )
    return TieredStore(cfg, MODEL, device=device)


def test_put_writes_back_to_disk_and_survives_restart(tmp_path, record):
    store = tiered(tmp_path)
    assert store.put(record)
    assert store.locate(record.key) == "host"
    store.flush()
    assert store.disk.contains(record.key)
    store.close()
    restarted = tiered(tmp_path)
    assert restarted.locate(record.key) == "disk"
    got = restarted.get(record.key, record.token_ids)
    assert got is not None and same_record(got, record)
    assert restarted.locate(record.key) == "host"  # promoted on the hit
    s = restarted.stats()
    assert s.hits == 1 and s.misses == 0
    restarted.close()


def test_host_eviction_demotes_to_disk(tmp_path):
    store = tiered(tmp_path, host_records=1, write_back="on_evict")
    a, b = make_record(seed=1), make_record(seed=2)
    store.put(a)
    store.flush()
    assert not store.disk.contains(a.key)  # demotion only, no write-through
    store.put(b)  # evicts a from host memory
    store.flush()
    assert store.locate(a.key) == "disk" and store.locate(b.key) == "host"
    got = store.get(a.key)
    assert got is not None and same_record(got, a)
    store.flush()
    # a was promoted, which evicted b, which was demoted in turn.
    assert store.locate(a.key) == "host" and store.locate(b.key) == "disk"
    store.close()


def test_sparse_disk_hit_queues_promotion(tmp_path):
    rec = make_record(num_tokens=30)
    first = tiered(tmp_path)
    first.put(rec)
    first.close()
    store = tiered(tmp_path)
    part = store.get_layers(rec.key, range(1, 2), [0, 29])
    assert part is not None and part.k.shape[1] == 2
    store.flush()
    assert store.host.contains(rec.key)
    assert store.tier_stats()["disk"].hits == 2  # the sparse read + the promotion read
    store.close()


def test_locate_asks_the_device_tier_first(tmp_path, record):
    class Device:
        def contains(self, key: str) -> bool:
            return key == record.key

    store = tiered(tmp_path, device=Device())
    assert store.locate(record.key) == "device"
    assert store.locate("0" * 64) is None
    store.close()


def test_lock_protects_in_host(tmp_path):
    store = tiered(tmp_path, host_records=1)
    a, b = make_record(seed=1), make_record(seed=2)
    store.put(a)
    assert store.lock(a.key)
    assert store.put(b)  # host is full and locked: b goes straight to disk
    store.flush()
    assert store.locate(a.key) == "host" and store.locate(b.key) == "disk"
    store.unlock(a.key)
    store.close()


def writer_threads(store: TieredStore) -> list[bool]:
    return [store.host._writer.thread_alive, store._promoter.thread_alive]


def test_queue_stats_count_write_back_drops(tmp_path, monkeypatch):
    # The first write is held until the others have been offered, so how many are
    # refused does not depend on the writer thread's timing.
    held = hold_disk_writes(monkeypatch)
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=20 * REC_BYTES, write_back_queue=2),
        disk=DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 24),
    )
    store = TieredStore(cfg, MODEL)
    try:
        assert store.put(make_record(seed=0))
        assert held.started.wait(10)
        for i in range(1, 8):
            assert store.put(make_record(seed=i))  # held in host memory either way
        stats = store.queue_stats()
        # One write running, two queued: the other five were refused.
        assert stats["writeback"].dropped == 5 and stats["tier_promotion"].dropped == 0
        assert stats["writeback"].submitted == 3
    finally:
        held.release.set()
        store.close()


def test_promotion_queue_drops_are_counted(tmp_path):
    recs = [make_record(seed=i, num_tokens=30) for i in range(6)]
    first = tiered(tmp_path)
    for r in recs:
        first.put(r)
    first.close()
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=20 * REC_BYTES),
        disk=DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 24),
        promotion_queue=1,
    )
    store = TieredStore(cfg, MODEL)
    entered, release = threading.Event(), threading.Event()
    real_get = store.disk.get

    def blocked_get(*args, **kwargs):
        entered.set()
        release.wait(5)
        return real_get(*args, **kwargs)

    store.disk.get = blocked_get  # the promoter's full reads wait
    for i, r in enumerate(recs):
        assert store.get_layers(r.key, range(0, 1), [0]) is not None
        if i == 0:
            assert entered.wait(5)  # the first promotion runs, off the queue
    dropped = store.queue_stats()["tier_promotion"].dropped
    release.set()
    store.flush()
    # The first promotion runs, one more waits in the queue: the other four are dropped.
    assert dropped == 4
    store.close()


@pytest.mark.parametrize("timeout_s", [0.0, 0.5, 30.0])
def test_shutdown_leaves_only_complete_files_and_counts_every_queued_write(
    tmp_path, monkeypatch, timeout_s
):
    hold_disk_writes(monkeypatch, 0.1).release.set()  # slow writes, none held
    store = tiered(tmp_path, host_records=20)
    recs = [make_record(seed=i) for i in range(10)]
    for r in recs:
        assert store.put(r)
    rep = store.shutdown(timeout_s)
    assert rep.joined and writer_threads(store) == [False, False]
    # The report counts what shutdown did; a slow runner may have finished writes
    # before it began, which only the cumulative counts hold.
    wb = store.queue_stats()["writeback"]
    assert (wb.submitted, wb.dropped, wb.failed, rep.failed) == (10, 0, 0, 0)
    assert wb.completed + wb.cancelled == 10
    assert rep.dropped == wb.cancelled and rep.completed <= wb.completed
    assert rep.seconds < timeout_s + 3.0
    if timeout_s == 30.0:
        assert wb.completed == 10
    elif timeout_s == 0.0:
        assert rep.completed <= 1  # at most the write already running
    monkeypatch.undo()
    # Only complete, checksum-valid files; no temp file; exactly the completed writes.
    on_disk = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert not [p for p in on_disk if p.name.startswith(TMP_PREFIX)]
    assert len(on_disk) == wb.completed
    by_key = {r.key: r for r in recs}
    for p in on_disk:
        got = read_record(p, MODEL)
        assert same_record(got, by_key[got.key])
    # After shutdown: lookups work, nothing more reaches the disk.
    late = make_record(seed=99)
    assert store.put(late) and store.get(recs[0].key) is not None
    assert not store.disk.contains(late.key)
    again = store.shutdown(1.0)  # idempotent
    assert (again.completed, again.dropped, again.joined) == (0, 0, True)
    assert store.queue_stats()["writeback"].dropped >= 1
    reopened = tiered(tmp_path)
    assert reopened.disk.stats().entries == wb.completed
    reopened.close()


def test_shutdown_stops_a_direct_disk_write_cleanly(tmp_path, monkeypatch):
    """A record host memory cannot take is written to disk on the caller's thread; a
    shutdown landing mid-write makes that put return False and leave no file."""
    store = tiered(tmp_path, host_records=0)
    writing, go = threading.Event(), threading.Event()
    real_write = os.write

    def slow_write(fd, data):
        writing.set()
        go.wait(5)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(store.put(make_record(seed=3))))
    t.start()
    assert writing.wait(5)
    rep = store.shutdown(0.0)
    go.set()
    t.join(5)
    assert result == [False] and rep.joined
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_bad_disk_header_is_dropped_on_peek_and_stored_afresh(tmp_path):
    # No host memory, so every repeat is served from disk (as in a server run with host
    # tier 0): a header that goes bad must not make the chunk miss forever.
    store = tiered(tmp_path, host_records=0)
    rec = make_record(seed=3)
    assert store.put(rec)
    assert store.locate(rec.key) == "disk"
    path = store.disk.path_of(rec.key)
    os.truncate(path, path.stat().st_size // 2)
    assert store.peek_ranking(rec.key, rec.token_ids) is None
    assert not store.contains(rec.key) and store.locate(rec.key) is None
    assert store.stats().errors.get("truncated") == 1 and not path.exists()
    # What LowerTiers.put_chunk does on the miss: the chunk is not held, so it is put.
    assert store.put(rec) and store.locate(rec.key) == "disk"
    peek = store.peek_ranking(rec.key, rec.token_ids)
    assert peek is not None and torch.equal(peek.ranking, rec.ranking)
    got = store.get(rec.key, rec.token_ids)
    assert got is not None and same_record(got, rec)
    store.close()
