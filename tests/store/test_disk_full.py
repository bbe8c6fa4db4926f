"""The disk tier on a file system smaller than its configured capacity: a write failing
for lack of space lowers the effective capacity, so later puts evict and succeed, and the
capacity grows back when the file system reports free space again.

The full disk is simulated: the writes of record files under the store's root fail with
the given errno once the bytes under the root would pass a fake limit, and ``statvfs``
reports the fake limit's free bytes."""

from __future__ import annotations

import errno
import os
import types

import pytest

from sgl_pic.store import format as fmt
from sgl_pic.store.disk import store as disk_mod
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from tests.store.helpers import MODEL, make_record, same_record

FILE_BYTES = fmt.encode_record(make_record(seed=0)).size  # every test record's file
CONFIGURED = 8 << 30  # what the tier is told it may hold


class FakeDisk:
    """A file system of ``limit`` bytes under ``root`` (the bytes of its files)."""

    def __init__(self, root, limit: int, err: int = errno.ENOSPC) -> None:
        self.root, self.limit, self.err = root, limit, err
        self.fds: set[int] = set()
        self.failures = 0

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def install(self, monkeypatch) -> None:
        real_open, real_write, real_close = os.open, os.write, os.close
        root = str(self.root)

        def open_(path, flags, *args, **kwargs):
            fd = real_open(path, flags, *args, **kwargs)
            if str(path).startswith(root) and flags & os.O_WRONLY:
                self.fds.add(fd)
            return fd

        def write(fd, data):
            if fd in self.fds and self.used() + memoryview(data).nbytes > self.limit:
                self.failures += 1
                raise OSError(self.err, os.strerror(self.err))
            return real_write(fd, data)

        def close(fd):
            self.fds.discard(fd)
            return real_close(fd)

        def statvfs(path):
            return types.SimpleNamespace(f_bavail=max(0, self.limit - self.used()), f_frsize=1)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "close", close)
        monkeypatch.setattr(disk_mod.os, "statvfs", statvfs)


def disk(root, policy="lru", capacity=CONFIGURED) -> DiskStore:
    return DiskStore(DiskStoreConfig(root=str(root), capacity_bytes=capacity, policy=policy), MODEL)


def record_files(root):
    return sorted(p.name for p in root.rglob("*.sglkv"))


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
@pytest.mark.parametrize("policy", ["lru", "lfu", "gdsf"])
def test_full_disk_lowers_capacity_and_later_puts_evict(tmp_path, monkeypatch, policy, err):
    # Not the store's: must survive the evictions (and takes part of the fake disk).
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"x" * 1000)
    (tmp_path / "ab").mkdir()
    stray = tmp_path / "ab" / "stray.bin"
    stray.write_bytes(b"y" * 1000)
    fake = FakeDisk(tmp_path, 3 * FILE_BYTES + FILE_BYTES // 2 + 2000, err)
    fake.install(monkeypatch)
    store = disk(tmp_path, policy)
    recs = [make_record(seed=i) for i in range(6)]
    for r in recs[:3]:
        assert store.put(r)
    # r0 is used, so under every policy r1 is the first to go, then r2.
    assert same_record(store.get(recs[0].key), recs[0])

    assert not store.put(recs[3])  # the disk is full: counted, nothing left behind
    s = store.stats()
    assert fake.failures == 1
    assert s.errors["enospc"] == 1 and s.errors["write_error"] == 1
    assert s.capacity_bytes == s.bytes_used == 3 * FILE_BYTES
    assert not store.contains(recs[3].key) and len(record_files(tmp_path)) == 3

    for r in recs[4:]:
        assert store.put(r)
    assert fake.failures == 1
    s = store.stats()
    assert s.errors["enospc"] == 1 and s.errors["write_error"] == 1
    assert s.puts == 5 and s.evictions == 2 and s.entries == 3
    assert s.bytes_used <= s.capacity_bytes <= CONFIGURED
    kept = [recs[0], recs[4], recs[5]]
    assert record_files(tmp_path) == sorted(store.path_of(r.key).name for r in kept)
    for gone in recs[1:4]:
        assert not store.contains(gone.key) and not store.path_of(gone.key).exists()
    assert foreign.read_bytes() == b"x" * 1000 and stray.read_bytes() == b"y" * 1000
    newest = store.get(recs[5].key, recs[5].token_ids)
    assert newest is not None and same_record(newest, recs[5])
    assert store.get_layers(recs[5].key, range(0, 2), [0, 5]) is not None
    assert same_record(store.get(recs[0].key), recs[0])


def test_full_disk_while_empty_recovers_when_space_returns(tmp_path, monkeypatch):
    fake = FakeDisk(tmp_path, FILE_BYTES // 2)
    fake.install(monkeypatch)
    store = disk(tmp_path)
    r0, r1 = make_record(seed=0), make_record(seed=1)
    assert not store.put(r0)
    assert store.stats().capacity_bytes == 0
    assert not store.put(r1)  # rejected by the lowered capacity, not by another write
    s = store.stats()
    assert fake.failures == 1 and s.rejected_puts == 1 and s.errors["enospc"] == 1

    fake.limit = 10 * FILE_BYTES  # space freed by someone else
    monkeypatch.setattr(store._regrowth, "next_check", 0.0)  # as if regrow_interval_s had passed
    assert store.put(r1)
    s = store.stats()
    assert s.capacity_bytes == 5 * FILE_BYTES  # half the free space reported
    assert same_record(store.get(r1.key), r1)


def test_regrowth_never_passes_the_configured_capacity(tmp_path, monkeypatch):
    fake = FakeDisk(tmp_path, FILE_BYTES + FILE_BYTES // 2)
    fake.install(monkeypatch)
    monkeypatch.setattr(DiskStore, "regrow_interval_s", 0.0)
    store = disk(tmp_path, capacity=4 * FILE_BYTES)
    recs = [make_record(seed=i) for i in range(4)]
    assert store.put(recs[0])
    assert not store.put(recs[1])
    assert store.stats().capacity_bytes == FILE_BYTES
    fake.limit = 1 << 30
    for r in recs[1:]:
        assert store.put(r)
    s = store.stats()
    assert s.capacity_bytes == 4 * FILE_BYTES and s.entries == 4 and s.evictions == 0


def test_regrowth_waits_for_the_interval(tmp_path, monkeypatch):
    fake = FakeDisk(tmp_path, FILE_BYTES // 2)
    fake.install(monkeypatch)
    store = disk(tmp_path)
    assert not store.put(make_record(seed=0))
    fake.limit = 1 << 30
    assert not store.put(make_record(seed=1))  # within regrow_interval_s: no statvfs yet
    assert store.stats().capacity_bytes == 0
    monkeypatch.setattr(store._regrowth, "next_check", 0.0)
    assert store.put(make_record(seed=1))


def test_efbig_counts_but_lowers_no_capacity(tmp_path, monkeypatch):
    # A per-file limit: evicting other records cannot help, so none are evicted.
    fake = FakeDisk(tmp_path, FILE_BYTES + FILE_BYTES // 2, errno.EFBIG)
    fake.install(monkeypatch)
    store = disk(tmp_path)
    r0, r1 = make_record(seed=0), make_record(seed=1)
    assert store.put(r0)
    assert not store.put(r1)
    s = store.stats()
    assert s.errors["enospc"] == 1 and s.capacity_bytes == CONFIGURED
    assert s.evictions == 0 and same_record(store.get(r0.key), r0)
