"""Deletion across servers sharing one store (a real Mooncake store): tombstones, the
records they cover, and records written after a deletion."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sgl_pic.store.deletion import Deletion, content_digest
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.shared.service import SharedStoreService
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from sgl_pic.store.store_link import LinkConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from sgl_pic.store.tombstones import decode_tombstone, encode_tombstone
from tests.store.helpers import MODEL, make_record, same_record

NS_A, NS_B = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def service() -> Iterator[SharedStoreService]:
    from tests.store.shared_helpers import start_service

    svc = start_service()
    yield svc
    svc.stop()


def server(root: Path, url: str) -> TieredStore:
    """One server's tiers; it reads the tombstone log before its first write, as the
    scheduler does before each lookup batch."""
    shared = SharedStore(SharedStoreConfig(url, link=LinkConfig(retry_s=0.5)), MODEL)
    assert shared.link.wait_connected(15)
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 22),
    )
    store = TieredStore(cfg, MODEL, shared=shared)
    store.sync_deletions()
    return store


def rec(seed: int, namespace: str = ""):  # noqa: ANN201
    return replace(make_record(seed=seed), namespace=namespace)


def in_store(store: TieredStore, key: str) -> bool:
    assert store.shared is not None
    return store.shared.link.call(lambda b: b.exists([key])[0])


def hold_everywhere(store: TieredStore, r) -> None:  # noqa: ANN001
    """``r`` from the shared tier into this server's host memory and disk."""
    got = store.get(r.key, r.token_ids)
    assert got is not None and same_record(got, r)
    assert store.disk.put(got)
    assert store.locate(r.key) == "host" and store.disk.contains(r.key)


def test_delete_by_namespace_reaches_the_other_server(
    tmp_path: Path, service: SharedStoreService
) -> None:
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    try:
        mine, other = rec(101, NS_A), rec(102, NS_B)
        a.put(mine)
        a.put(other)
        a.flush()
        hold_everywhere(b, mine)
        hold_everywhere(b, other)
        report = a.delete(Deletion(namespaces=frozenset({NS_A})))
        assert report["shared"].records == 1  # a wrote it, so it can name it
        assert report["host"].records == 1 and report["disk"].records == 1
        assert not in_store(a, mine.key) and in_store(a, other.key)
        found = b.sync_deletions()
        assert found == (Deletion(namespaces=frozenset({NS_A})),)
        assert b.locate(mine.key) is None  # b's own host and disk copies are gone
        assert b.get(mine.key, mine.token_ids) is None
        assert b.get(other.key, other.token_ids) is not None  # another tenant: kept
        assert b.sync_deletions() == ()  # nothing new: nothing returned
    finally:
        a.close()
        b.close()


def test_delete_by_content_covers_records_the_deleter_never_saw(
    tmp_path: Path, service: SharedStoreService
) -> None:
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    try:
        doc = rec(111, NS_B)
        b.put(doc)  # written by b: a does not know its key
        b.flush()
        report = a.delete(Deletion(contents=frozenset({content_digest(doc.token_ids)})))
        assert report["shared"].records == 0
        assert in_store(a, doc.key)  # still there: nobody listed it
        c = server(tmp_path / "c", service.url)  # a third server, synced
        try:
            assert c.get(doc.key, doc.token_ids) is None  # the tombstone covers it
            assert c.tier_stats()["shared"].hits == 0
            assert not in_store(c, doc.key)  # and the reader removed it
        finally:
            c.close()
        b.sync_deletions()
        assert b.locate(doc.key) is None
        # The tenant sends the document again: written after the deletion, it is served.
        b.put(doc)
        b.flush()
        assert in_store(b, doc.key)
        got = a.get(doc.key, doc.token_ids)
        assert got is not None and same_record(got, doc)
    finally:
        a.close()
        b.close()


def test_record_written_again_by_the_deleter_is_served(
    tmp_path: Path, service: SharedStoreService
) -> None:
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    try:
        doc = rec(121, NS_A)
        a.put(doc)
        a.flush()
        a.delete(
            Deletion(
                namespaces=frozenset({NS_A}), contents=frozenset({content_digest(doc.token_ids)})
            )
        )
        a.put(doc)  # sent again
        a.flush()
        b.sync_deletions()
        got = b.get(doc.key, doc.token_ids)
        assert got is not None and same_record(got, doc)
    finally:
        a.close()
        b.close()


def test_shared_write_queued_before_a_deletion_is_dropped(
    tmp_path: Path, service: SharedStoreService
) -> None:
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    assert a.shared is not None
    try:
        gate = threading.Event()
        assert a.shared.writer.queue.submit(lambda: gate.wait(30))  # holds the writer thread
        doc = rec(131, NS_A)
        assert a.put(doc)  # its shared write waits behind the held job
        a.delete(Deletion(namespaces=frozenset({NS_A})))
        gate.set()
        a.flush()
        assert not in_store(a, doc.key)
        assert a.shared.write_counts()["stored"] == 0
        b.sync_deletions()
        assert b.get(doc.key, doc.token_ids) is None
    finally:
        a.close()
        b.close()


def test_two_servers_appending_tombstones_read_each_others(
    tmp_path: Path, service: SharedStoreService
) -> None:
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    assert a.shared is not None and b.shared is not None
    try:
        d1 = Deletion(namespaces=frozenset({"1" * 64}))
        d2 = Deletion(namespaces=frozenset({"2" * 64}))
        before = a.shared.deletions.tombstones.read
        a.delete(d1)
        b.delete(d2)  # b has not read d1's slot: it meets it, and takes the next one
        assert b.shared.deletions.tombstones.read == before + 2
        assert b.sync_deletions() == (d1,)
        assert a.sync_deletions() == (d2,)
        assert a.sync_deletions() == () and b.sync_deletions() == ()
    finally:
        a.close()
        b.close()


def test_tombstone_bytes_round_trip_and_refuse_garbage() -> None:
    d = Deletion(namespaces=frozenset({"", NS_A}), contents=frozenset({"c" * 64}))
    assert decode_tombstone(encode_tombstone(d, "w")) == (d, "w")
    for bad in (b"\x00\x01", b"\x93\x01\x02\x03"):
        with pytest.raises(ValueError):
            decode_tombstone(bad)
    import msgpack

    wrong = msgpack.packb({"v": 1, "writer": "w", "namespaces": ["../x"], "contents": None})
    with pytest.raises(ValueError):
        decode_tombstone(wrong)


def test_record_header_carries_the_tombstones_its_writer_had_applied(tmp_path: Path) -> None:
    from sgl_pic.store.format import encode_record, read_header, write_record

    r = make_record(seed=1)
    for seen in (0, 7):
        path = tmp_path / f"{seen}.sglkv"
        write_record(path, encode_record(r, 32, seen))
        assert read_header(path, MODEL).tombstones_seen == seen


def test_deletion_made_while_the_store_is_down_reaches_the_others_when_it_is_back(
    tmp_path: Path,
) -> None:
    import time

    from tests.store.shared_helpers import start_service

    svc = start_service()
    a, b = server(tmp_path / "a", svc.url), server(tmp_path / "b", svc.url)
    assert a.shared is not None
    try:
        doc = rec(141, NS_A)
        a.put(doc)
        a.flush()
        hold_everywhere(b, doc)
        svc.kill()
        a.shared.headers.clear()  # force a round trip to the dead store
        assert a.shared.get(doc.key) is None  # finds the store down
        report = a.delete(Deletion(namespaces=frozenset({NS_A})))
        assert report["host"].records == 1 and report["disk"].records == 1
        assert a.shared.unsent_deletions() == 1
        svc.start()
        deadline = time.monotonic() + 30
        while a.shared.unsent_deletions() and time.monotonic() < deadline:
            a.shared.contains(doc.key)  # a probe once the retry period has passed
            a.sync_deletions()  # retries the tombstone
            time.sleep(0.2)
        assert a.shared.unsent_deletions() == 0
        found: tuple[Deletion, ...] = ()
        while not found and time.monotonic() < deadline:  # b finds the store back too
            found = b.sync_deletions()
            time.sleep(0.2)
        assert found == (Deletion(namespaces=frozenset({NS_A})),)
        assert b.locate(doc.key) is None
    finally:
        a.close()
        b.close()
        svc.stop()


def test_a_tombstone_of_a_first_chunk_covers_the_records_encoded_after_it(
    tmp_path: Path, service: SharedStoreService
) -> None:
    """Another server's record encoded after a first chunk (its shared header carries the
    chunk's contents) is covered by a deletion of that chunk's content it never saw."""
    a, b = server(tmp_path / "a", service.url), server(tmp_path / "b", service.url)
    try:
        system = rec(121)
        after = replace(rec(122), context_contents=(content_digest(system.token_ids),))
        b.put(after)
        b.flush()
        a.delete(Deletion(contents=frozenset({content_digest(system.token_ids)})))
        c = server(tmp_path / "c", service.url)
        try:
            assert c.get(after.key, after.token_ids) is None  # the tombstone covers it
            assert not in_store(c, after.key)
        finally:
            c.close()
        b.sync_deletions()
        assert b.locate(after.key) is None  # b's own copies are gone too
    finally:
        a.close()
        b.close()
