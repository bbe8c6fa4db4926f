from sgl_pic.store.disk import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.helpers import MODEL, make_record, same_record

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
