"""The shared tier on a real Mooncake store: round trips, sparse verified reads, writes
de-duplicated across clients, bad objects, and an unreachable or restarted store."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sgl_pic.store.format import encode_record
from sgl_pic.store.object_backend import StoreAddress, make_backend
from sgl_pic.store.shared.service import SharedStoreService
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from sgl_pic.store.store_link import LinkConfig
from tests.store.helpers import MODEL, OTHER_MODEL, make_record, same_record
from tests.store.shared_helpers import free_port_block, start_service

FAST = LinkConfig(op_timeout_s=2.0, retry_s=0.5)


@pytest.fixture(scope="module")
def service() -> Iterator[SharedStoreService]:
    svc = start_service()
    yield svc
    svc.stop()


def connect(url: str, model: str = MODEL) -> SharedStore:
    store = SharedStore(SharedStoreConfig(url, link=FAST), model)
    assert store.link.wait_connected(15), "could not join the shared store"
    return store


@pytest.fixture
def stores(service: SharedStoreService) -> Iterator[tuple[SharedStore, SharedStore]]:
    """Two clients of one store: two servers' shared tiers."""
    a, b = connect(service.url), connect(service.url)
    yield a, b
    a.close()
    b.close()


def raw_put(url: str, key: str, data: bytes) -> None:
    backend = make_backend(url)
    backend.connect()
    try:
        backend.remove(key)
        backend.put_if_absent(key, [data])
    finally:
        backend.close()


def test_url_parsing() -> None:
    a = StoreAddress.parse("mooncake://10.0.0.2:50551")
    assert (a.host, a.port, a.metadata_url) == ("10.0.0.2", 50551, "http://10.0.0.2:50552/metadata")
    assert StoreAddress.parse("mooncake://h:1?metadata=http://m:9/x").metadata_url == "http://m:9/x"
    for bad in ("redis://h:1", "mooncake://h", "mooncake://:5", "mooncake://h:1?x=1", "h:1"):
        with pytest.raises(ValueError):
            StoreAddress.parse(bad)


def test_written_by_one_read_by_another(stores: tuple[SharedStore, SharedStore]) -> None:
    a, b = stores
    rec = make_record(seed=11, num_tokens=70)
    assert not b.contains(rec.key)
    assert a.put(rec)
    a.flush()
    assert b.contains(rec.key)
    got = b.get(rec.key, rec.token_ids)
    assert got is not None and same_record(got, rec)
    assert torch.equal(b.peek_ranking(rec.key, rec.token_ids), rec.ranking)  # type: ignore[arg-type]


def test_put_keeps_what_was_put_when_the_caller_reuses_its_tensors(
    stores: tuple[SharedStore, SharedStore],
) -> None:
    # The write runs later, on the writer thread; the caller may reuse its buffers as
    # soon as put returns (the writer is held busy here, as under load).
    a, b = stores
    rec, want = make_record(seed=12), make_record(seed=12)
    gate = threading.Event()
    assert a.writer.queue.submit(gate.wait)
    try:
        assert a.put(rec)
        rec.k.zero_()
        rec.v.fill_(7.0)
    finally:
        gate.set()
    a.flush()
    got = b.get(want.key, want.token_ids)
    assert got is not None and same_record(got, want)


def test_sparse_layer_read_is_verified_and_moves_only_touched_blocks(
    stores: tuple[SharedStore, SharedStore],
) -> None:
    a, b = stores
    rec = make_record(seed=12, num_layers=4, num_tokens=100)
    a.put(rec)
    a.flush()
    before = b.stats().bytes_read
    idx = [3, 4, 97]
    part = b.get_layers(rec.key, range(1, 3), torch.tensor(idx), rec.token_ids)
    assert part is not None
    assert torch.equal(part.k, rec.k[1:3][:, idx]) and torch.equal(part.v, rec.v[1:3][:, idx])
    assert part.bytes_read == 2 * 2 * 3 * rec.row_bytes
    moved = b.stats().bytes_read - before
    # Two of four 32-token blocks per (layer, K/V): 32 + 4 (the short last block) rows.
    assert moved == 2 * 2 * (32 + 4) * rec.row_bytes


def test_writes_are_deduplicated_within_and_across_clients(
    stores: tuple[SharedStore, SharedStore],
) -> None:
    a, b = stores
    rec = make_record(seed=13)
    assert a.put(rec) and a.put(rec)  # the second is already queued: not queued again
    a.flush()
    assert a.write_counts()["stored"] == 1
    assert a.writer_stats().submitted == 1
    assert b.put(rec)
    b.flush()
    assert b.write_counts() == {
        "stored": 0,
        "present": 1,
        "failed": 0,
        "skipped": 0,
        "backfilled": 0,
    }


@pytest.mark.parametrize("read", ["get", "get_layers"])
def test_a_key_stored_anew_by_another_server_is_read_not_removed(
    stores: tuple[SharedStore, SharedStore], service: SharedStoreService, read: str
) -> None:
    # The store may evict an object and another server store the key again with KV that
    # is not the same bytes (recomputed): a header this client cached from the first
    # object must not make the second one read as corrupt and be removed for everyone.
    a, b = stores
    first = make_record(seed=15)
    again = dataclasses.replace(first, k=first.k + 1e-6)
    assert a.put(first)
    a.flush()
    assert a.get(first.key, first.token_ids) is not None  # its header is cached now
    enc = encode_record(again)
    raw_put(service.url, first.key, enc.head + b"".join(area.tobytes() for area in enc.areas))
    if read == "get":
        got = a.get(first.key, first.token_ids)
        assert got is not None and same_record(got, again)
    else:
        part = a.get_layers(first.key, range(0, 1), [0, 1], first.token_ids)
        assert part is not None and torch.equal(part.k, again.k[0:1, [0, 1]])
    assert b.contains(first.key) and sum(a.stats().errors.values()) == 0


def test_concurrent_writers_store_one_object(service: SharedStoreService) -> None:
    rec = make_record(seed=14, num_tokens=64)
    clients = [connect(service.url) for _ in range(3)]
    try:
        for c in clients:
            c.put(rec)
        for c in clients:
            c.flush()
        assert sum(c.write_counts()["failed"] for c in clients) == 0
        reader = clients[0]
        reader.headers.clear()
        got = reader.get(rec.key, rec.token_ids)
        assert got is not None and same_record(got, rec)
    finally:
        for c in clients:
            c.close()


def test_corrupt_object_is_counted_removed_and_missed(
    stores: tuple[SharedStore, SharedStore], service: SharedStoreService
) -> None:
    a, b = stores
    rec = make_record(seed=15, num_tokens=40)
    enc = encode_record(rec)
    data = bytearray(enc.head + b"".join(x.tobytes() for x in enc.areas))
    data[len(enc.head) + 100] ^= 0xFF  # a payload byte of layer 0's K
    raw_put(service.url, rec.key, bytes(data))
    assert b.get_layers(rec.key, range(0, 1), [1, 2], rec.token_ids) is None
    assert b.stats().errors["corrupt"] == 1
    assert not b.contains(rec.key)  # removed, so the next writer stores it afresh
    assert a.put(rec)
    a.flush()
    got = b.get(rec.key, rec.token_ids)
    assert got is not None and same_record(got, rec)


def test_truncated_and_garbage_objects_are_misses(
    stores: tuple[SharedStore, SharedStore], service: SharedStoreService
) -> None:
    _, b = stores
    rec = make_record(seed=16)
    enc = encode_record(rec)
    raw_put(service.url, rec.key, enc.head + enc.areas[0].tobytes())
    assert b.get(rec.key) is None
    assert b.stats().errors["truncated"] == 1
    rec2 = make_record(seed=17)
    raw_put(service.url, rec2.key, b"not a chunk at all" * 100)
    assert b.get(rec2.key) is None
    assert sum(b.stats().errors.values()) == 2


def test_other_models_records_are_never_served_or_removed(
    stores: tuple[SharedStore, SharedStore], service: SharedStoreService
) -> None:
    a, _ = stores
    other = connect(service.url, OTHER_MODEL)
    try:
        rec = make_record(seed=18, model=OTHER_MODEL)
        assert not a.put(rec)  # refused: a record of another model
        assert a.stats().errors["foreign_model"] == 1
        other.put(rec)
        other.flush()
        assert a.get(rec.key) is None
        assert a.stats().errors["foreign_model"] == 2
        assert other.get(rec.key) is not None  # still there for its own model
    finally:
        other.close()


def test_token_mismatch_is_a_miss(stores: tuple[SharedStore, SharedStore]) -> None:
    a, b = stores
    rec = make_record(seed=19)
    a.put(rec)
    a.flush()
    wrong = list(rec.token_ids)
    wrong[0] += 1
    assert b.get(rec.key, wrong) is None
    assert b.stats().errors["token_mismatch"] == 1


def test_unreachable_store_answers_misses_at_once() -> None:
    url = f"mooncake://127.0.0.1:{free_port_block()}"
    store = SharedStore(SharedStoreConfig(url, link=FAST), MODEL)
    try:
        rec = make_record(seed=20)
        t0 = time.monotonic()
        assert store.get(rec.key) is None
        assert not store.contains(rec.key)
        assert store.get_layers(rec.key, range(0, 1)) is None
        assert not store.put(rec)
        assert time.monotonic() - t0 < 1.0
        assert store.link_stats().up is False
        assert store.write_counts()["skipped"] == 1
    finally:
        store.close()


def test_store_killed_and_restarted() -> None:
    svc = start_service()
    try:
        store = connect(svc.url)
        rec = make_record(seed=21, num_tokens=50)
        store.put(rec)
        store.flush()
        svc.kill()
        store.headers.clear()  # force a round trip to the dead store
        t0 = time.monotonic()
        assert store.get(rec.key) is None
        assert store.get(rec.key) is None  # the breaker is open: no second wait
        assert time.monotonic() - t0 < FAST.op_timeout_s + 0.5
        link = store.link_stats()
        assert not link.up and link.outages == 1
        svc.start()
        deadline = time.monotonic() + 30
        while not store.put(rec) and time.monotonic() < deadline:
            store.contains(rec.key)  # a probe once the retry period has passed
            time.sleep(0.2)
        store.flush()
        got = store.get(rec.key, rec.token_ids)
        assert got is not None and same_record(got, rec)
        assert store.link_stats().up and store.link_stats().outages == 1
        store.close()
    finally:
        svc.stop()


def test_backend_reads_ranges(service: SharedStoreService) -> None:
    backend = make_backend(service.url)
    backend.connect()
    try:
        data = np.arange(10000, dtype=np.uint8)
        backend.put_if_absent("range-test", [data[:5000], data[5000:]])
        got = backend.read_ranges("range-test", [(10, 5), (9000, 3)])
        assert got is not None and got.tolist() == data[10:15].tolist() + data[9000:9003].tolist()
        assert backend.read_ranges("no-such-key", [(0, 1)]) is None
        assert backend.size("range-test") == 10000 and backend.size("no-such-key") is None
        backend.remove("range-test")
        assert backend.exists(["range-test"]) == [False]
    finally:
        backend.close()
