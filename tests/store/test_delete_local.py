"""Deletion in the host and disk tiers and through TieredStore: by namespace, by content,
by both; locked entries; records of an earlier run; work queued before a deletion."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from sgl_pic.store.deletion import DeleteReport, Deletion, content_digest
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.host import HostStore, HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.helpers import MODEL, hold_disk_writes, make_record

NS_A, NS_B = "a" * 64, "b" * 64
REC_BYTES = make_record().nbytes


def rec(seed: int, namespace: str = ""):  # noqa: ANN201
    return replace(make_record(seed=seed), namespace=namespace)


def by_ns(*names: str) -> Deletion:
    return Deletion(namespaces=frozenset(names))


def by_content(*records) -> Deletion:  # noqa: ANN002
    return Deletion(contents=frozenset(content_digest(r.token_ids) for r in records))


def host(n: int = 10) -> HostStore:
    return HostStore(HostStoreConfig(n * REC_BYTES, pin_memory=False), MODEL)


def disk(root: Path) -> DiskStore:
    return DiskStore(DiskStoreConfig(str(root), 1 << 24), MODEL)


def tiered(root: Path) -> TieredStore:
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=10 * REC_BYTES, pin_memory=False),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 24),
    )
    return TieredStore(cfg, MODEL)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_delete_by_namespace_content_and_both(tier: str, tmp_path: Path) -> None:
    store = host() if tier == "host" else disk(tmp_path)
    a1, a2, b1, d1 = rec(1, NS_A), rec(2, NS_A), rec(3, NS_B), rec(4, "")
    b_same = replace(rec(2, NS_B), key=rec(5).key)  # a2's tokens under tenant B
    for r in (a1, a2, b1, d1, b_same):
        assert store.put(r)
    # By content and namespace: only tenant B's copy of a2's tokens goes.
    both = Deletion(namespaces=frozenset({NS_B}), contents=by_content(a2).contents)
    report = store.delete(both)
    assert report.records == 1 and report.nbytes > 0
    assert not store.contains(b_same.key) and store.contains(a2.key)
    # By namespace: everything of tenant A, nothing else.
    assert store.delete(by_ns(NS_A)).records == 2
    assert not store.contains(a1.key) and not store.contains(a2.key)
    assert store.get(a1.key) is None
    assert store.contains(b1.key) and store.contains(d1.key)
    # By content, any namespace; the default namespace "" is a namespace like others.
    assert store.delete(by_content(d1)).records == 1
    assert not store.contains(d1.key) and store.contains(b1.key)
    assert store.delete(by_ns(NS_A)) == DeleteReport(0, 0)
    assert store.stats().entries == 1
    assert store.bytes_by_namespace() == {NS_B: store.stats().bytes_used}
    if isinstance(store, DiskStore):
        assert not store.path_of(a1.key).exists() and store.path_of(b1.key).exists()


def test_disk_deletes_records_of_an_earlier_run(tmp_path: Path) -> None:
    first = disk(tmp_path)
    a, b = rec(1, NS_A), rec(2, NS_B)
    first.put(a)
    first.put(b)
    again = disk(tmp_path)  # index rebuilt from the record headers
    assert again.bytes_by_namespace().keys() == {NS_A, NS_B}
    assert again.delete(by_content(b)).records == 1
    assert again.delete(by_ns(NS_A)).records == 1
    assert not again.path_of(a.key).exists() and not again.path_of(b.key).exists()
    assert disk(tmp_path).stats().entries == 0


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_locked_entry_leaves_the_index_at_once_and_its_bytes_at_unlock(
    tier: str, tmp_path: Path
) -> None:
    store = host() if tier == "host" else disk(tmp_path)
    a = rec(1, NS_A)
    store.put(a)
    used = store.stats().bytes_used
    assert store.lock(a.key) and store.lock(a.key)
    assert store.delete(by_ns(NS_A)).records == 1
    assert not store.contains(a.key) and store.get(a.key) is None
    assert not store.lock(a.key)  # never found again
    assert store.stats().bytes_used == used  # still held by the reader
    store.unlock(a.key)
    assert store.stats().bytes_used == used
    store.unlock(a.key)
    assert store.stats().bytes_used == 0 and store.bytes_by_namespace() == {}
    # Stored again afterwards (the tenant sent it again): found, and kept by a stray unlock.
    assert store.put(a) and store.contains(a.key)
    store.unlock(a.key)
    assert store.contains(a.key)


def test_deletion_log_covers_only_later_matching_deletions() -> None:
    log = DeletionLog(keep=2)
    a = rec(1, NS_A)
    since = log.seq
    assert not log.covers(since, NS_A, content_digest(a.token_ids))
    log.append(by_ns(NS_B))
    assert not log.covers(since, NS_A, content_digest(a.token_ids))
    log.append(by_content(a))
    assert log.covers(since, NS_A, content_digest(a.token_ids))
    assert not log.covers(log.seq, NS_A, content_digest(a.token_ids))
    log.append(by_ns(NS_B))  # the first one is forgotten: a job older than it is covered
    assert log.covers(since, "", "0" * 64)
    assert not log.covers(since + 1, "", "0" * 64)


def test_tiered_delete_reports_each_tier(tmp_path: Path) -> None:
    store = tiered(tmp_path)
    a, b = rec(1, NS_A), rec(2, NS_B)
    store.put(a)
    store.put(b)
    store.flush()
    report = store.delete(by_ns(NS_A))
    assert set(report) == {"host", "disk"}
    assert report["host"].records == 1 and report["disk"].records == 1
    assert store.locate(a.key) is None and store.get(a.key) is None
    assert store.locate(b.key) == "host"
    assert store.sync_deletions() == ()  # no shared tier
    store.close()


def test_write_back_queued_before_a_deletion_never_reaches_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = hold_disk_writes(monkeypatch)
    store = tiered(tmp_path)
    first, queued = rec(1, NS_B), rec(2, NS_A)
    store.put(first)  # its write holds the writer thread
    assert held.started.wait(10)
    store.put(queued)  # queued behind it
    store.delete(by_ns(NS_A, NS_B))  # first: mid-write; queued: not started
    held.release.set()
    store.flush()
    for r in (first, queued):
        assert not store.disk.contains(r.key) and not store.disk.path_of(r.key).exists()
        assert store.locate(r.key) is None
    assert store.disk.stats().entries == 0
    store.close()
    assert disk(tmp_path).stats().entries == 0  # nothing left for a restart to find


def test_promotion_of_a_record_deleted_after_its_read_is_dropped(tmp_path: Path) -> None:
    a = rec(1, NS_A)
    first = tiered(tmp_path)
    first.put(a)
    first.close()
    store = tiered(tmp_path)
    real_get = store.disk.get
    read = threading.Event()

    def get_then_delete(key, token_ids=None):  # noqa: ANN001, ANN202
        out = real_get(key, token_ids)
        if threading.current_thread().name == "sgl-pic-promote" and not read.is_set():
            read.set()
            store.delete(by_ns(NS_A))  # arrives between the promotion's read and insert
        return out

    store.disk.get = get_then_delete  # type: ignore[method-assign]
    assert store.get_layers(a.key, range(0, 1), [0, 1]) is not None
    store.flush()
    assert read.is_set()
    assert not store.host.contains(a.key) and store.locate(a.key) is None
    assert store.host.stats().puts == 0
    store.close()


def test_deletion_amid_many_slow_write_backs_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-backs of two tenants are queued and running (each write slowed) when one
    tenant is deleted: none of its records stays anywhere; the other's all reach disk."""
    hold_disk_writes(monkeypatch, seconds=0.005).release.set()
    store = tiered(tmp_path)
    gone = [rec(300 + i, NS_A) for i in range(8)]
    kept = [rec(400 + i, NS_B) for i in range(8)]
    for a, b in zip(gone, kept, strict=True):
        store.put(a)
        store.put(b)
    store.delete(by_ns(NS_A))
    store.flush()
    assert all(store.locate(r.key) is None for r in gone)
    assert all(store.disk.contains(r.key) for r in kept)
    assert store.disk.bytes_by_namespace().keys() == {NS_B}
    store.close()
    assert disk(tmp_path).bytes_by_namespace().keys() == {NS_B}


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_record_encoded_after_a_first_chunk_goes_with_its_content(
    tier: str, tmp_path: Path
) -> None:
    """A record carries the contents of the first chunk it was encoded after (its header
    on disk, read again by a later run's index): deleting that chunk's content deletes it,
    and deleting its own content still does."""
    first, other = rec(1), rec(2)
    after = replace(rec(3), context_contents=(content_digest(first.token_ids),))
    alone = rec(4)
    elsewhere = replace(rec(5), context_contents=(content_digest(other.token_ids),))
    store = host() if tier == "host" else disk(tmp_path)
    for r in (first, after, alone, elsewhere):
        assert store.put(r)
    if isinstance(store, DiskStore):
        store = disk(tmp_path)  # the index rebuilt from the headers
        got = store.get(after.key, after.token_ids)
        assert got is not None and got.context_contents == after.context_contents
    assert store.delete(by_content(first)).records == 2  # first, and the one after it
    assert not store.contains(after.key) and store.contains(alone.key)
    assert store.contains(elsewhere.key)  # encoded after another first chunk: kept
    assert store.delete(by_content(elsewhere)).records == 1  # by its own content too
