import errno
import os
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from sgl_pic.store import format as fmt
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.format import (
    FORMAT_VERSION,
    TMP_PREFIX,
    WriteCancelled,
    read_header,
    tmp_name,
)
from tests.store.helpers import MODEL, OTHER_MODEL, make_record, same_record

FILE_BYTES = 3 * 4096  # a default test record's file: 4096 header page + 7680 payload


def disk(root, capacity=100 * FILE_BYTES, model=MODEL, **kw) -> DiskStore:
    return DiskStore(DiskStoreConfig(root=str(root), capacity_bytes=capacity, **kw), model)


def files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_round_trip_and_paths_come_from_the_digest(tmp_path, record):
    store = disk(tmp_path)
    assert store.put(record)
    assert store.put(record)  # same key again: a no-op
    assert files(tmp_path) == [f"{record.key[:2]}/{record.key}.sglkv"]
    got = store.get(record.key, record.token_ids)
    assert got is not None and same_record(got, record)
    s = store.stats()
    assert (s.entries, s.puts, s.hits) == (1, 1, 1)
    with pytest.raises(ValueError):
        store.get("../../etc/passwd")


def test_get_layers_is_sparse_and_verified(tmp_path):
    rec = make_record(num_layers=4, num_tokens=64, layer_start=2)
    store = disk(tmp_path, block_tokens=8)
    store.put(rec)
    part = store.get_layers(rec.key, range(3, 5), [5, 60])
    assert part is not None
    assert torch.equal(part.k, rec.k[1:3, [5, 60]]) and torch.equal(part.v, rec.v[1:3, [5, 60]])
    assert part.bytes_read == 2 * 2 * 2 * rec.row_bytes
    assert store.stats().bytes_read == part.bytes_read


def test_index_is_rebuilt_after_restart(tmp_path):
    recs = [make_record(seed=i) for i in range(4)]
    first = disk(tmp_path)
    for r in recs:
        first.put(r)
    first.get(recs[0].key)
    del first
    second = disk(tmp_path)
    assert second.stats().entries == 4
    assert second.stats().bytes_used == sum(p.stat().st_size for p in tmp_path.rglob("*.sglkv"))
    for r in recs:
        got = second.get(r.key, r.token_ids)
        assert got is not None and same_record(got, r)


def test_a_file_with_mistyped_header_fields_neither_stops_a_restart_nor_a_read(tmp_path):
    from tests.store.test_format import _with_header

    good, bad = make_record(seed=1), make_record(seed=2)
    first = disk(tmp_path)
    first.put(good)
    first.put(bad)
    del first
    _with_header(disk(tmp_path).path_of(bad.key), dtype=["float32"], num_tokens=float("inf"))
    second = disk(tmp_path)  # the index rebuild reads every header
    assert second.get(bad.key) is None and second.peek_header(bad.key) is None
    got = second.get(good.key, good.token_ids)
    assert got is not None and same_record(got, good)


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_corrupt_file_is_a_counted_miss_and_removed(tmp_path):
    good, bad = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(good)
    store.put(bad)
    path = store.path_of(bad.key)
    h = read_header(path)
    _flip(path, h.data_offset + 2 * h.layer_bytes + 3)  # layer 1, K
    # A layer untouched by the damage still verifies...
    assert store.get_layers(bad.key, range(0, 1)) is not None
    # ...the damaged one never comes back, and the entry is gone.
    assert store.get_layers(bad.key, range(1, 2)) is None
    assert store.stats().errors["corrupt"] == 1
    assert not store.contains(bad.key) and not path.exists()
    assert store.get(bad.key) is None
    got = store.get(good.key)
    assert got is not None and same_record(got, good)


def test_truncated_file_is_a_miss(tmp_path):
    good, bad = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(good)
    store.put(bad)
    path = store.path_of(bad.key)
    os.truncate(path, path.stat().st_size - 100)
    assert store.get(bad.key) is None
    assert store.stats().errors["truncated"] == 1 and not store.contains(bad.key)
    assert store.get(good.key) is not None
    # At start-up too: a truncated file is not indexed.
    store.put(bad)
    os.truncate(store.path_of(bad.key), 10)
    reopened = disk(tmp_path)
    assert reopened.contains(good.key) and not reopened.contains(bad.key)
    assert reopened.stats().errors["truncated"] == 1


def test_foreign_model_files_are_skipped_not_deleted(tmp_path):
    mine, theirs = make_record(seed=1), make_record(seed=2, model=OTHER_MODEL)
    disk(tmp_path).put(mine)
    disk(tmp_path, model=OTHER_MODEL).put(theirs)
    store = disk(tmp_path)
    assert store.contains(mine.key) and not store.contains(theirs.key)
    assert store.stats().errors["foreign_model"] == 1
    assert disk(tmp_path, model=OTHER_MODEL).get(theirs.key) is not None
    assert not store.put(theirs)  # a foreign record is never accepted either


def test_newer_format_is_skipped_at_start_and_a_miss_at_read(tmp_path):
    old, new = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(old)
    store.put(new)
    path = store.path_of(new.key)
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", FORMAT_VERSION + 1)
    path.write_bytes(bytes(raw))
    assert store.get(new.key) is None  # indexed before the change: caught at read
    assert store.stats().errors["newer_format"] == 1
    assert path.exists()  # a newer binary may share the directory
    reopened = disk(tmp_path)
    assert not reopened.contains(new.key) and reopened.stats().errors["newer_format"] == 1
    assert reopened.get(old.key) is not None


def test_wrong_tokens_is_a_miss(tmp_path, record):
    store = disk(tmp_path)
    store.put(record)
    assert store.get(record.key, [t + 1 for t in record.token_ids]) is None
    assert store.stats().errors["token_mismatch"] == 1 and not store.contains(record.key)


@pytest.mark.parametrize("call", ["write", "fsync", "replace"])
def test_enospc_leaves_no_file_no_entry_and_store_keeps_working(tmp_path, monkeypatch, call):
    kept, lost = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(kept)
    real = getattr(os, call)
    n = {"calls": 0}

    def failing(*args, **kwargs):
        n["calls"] += 1
        if call != "write" or n["calls"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, failing)
    assert not store.put(lost)
    monkeypatch.undo()
    s = store.stats()
    assert s.errors["enospc"] == 1 and s.errors["write_error"] == 1
    assert not store.contains(lost.key) and s.entries == 1
    assert files(tmp_path) == [f"{kept.key[:2]}/{kept.key}.sglkv"]
    assert s.bytes_used == store.path_of(kept.key).stat().st_size
    assert same_record(store.get(kept.key), kept)
    assert store.put(lost) and same_record(store.get(lost.key), lost)


def test_unreadable_file_is_a_miss(tmp_path, monkeypatch):
    good, bad = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(good)
    store.put(bad)
    bad_path = str(store.path_of(bad.key))
    real_open = os.open

    def guarded_open(path, flags, *args):
        # As if the file were chmod 000 for a non-root user (tests may run as root).
        if str(path) == bad_path:
            raise PermissionError(errno.EACCES, "Permission denied", bad_path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", guarded_open)
    assert store.get(bad.key) is None
    assert store.get_layers(good.key, range(0, 1)) is not None
    assert store.stats().errors["unreadable"] == 1 and not store.contains(bad.key)
    assert same_record(store.get(good.key), good)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of mode")
def test_unreadable_file_by_permissions(tmp_path):
    good, bad = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(good)
    store.put(bad)
    os.chmod(store.path_of(bad.key), 0)
    assert store.get(bad.key) is None and store.stats().errors["unreadable"] == 1
    assert disk(tmp_path).contains(good.key)


def test_capacity_eviction_respects_locks(tmp_path):
    recs = [make_record(seed=i) for i in range(4)]
    size = len(fmt.encode_record(recs[0]).head) + recs[0].nbytes
    store = disk(tmp_path, capacity=3 * size)
    for r in recs[:3]:
        store.put(r)
    store.lock(recs[0].key)
    store.get(recs[1].key)  # recs[2] is now least recently used among unlocked
    assert store.put(recs[3])
    assert store.contains(recs[0].key) and store.contains(recs[1].key)
    assert not store.contains(recs[2].key) and not store.path_of(recs[2].key).exists()
    assert store.stats().bytes_used <= 3 * size
    for r in recs[:2]:
        store.lock(r.key)
    store.lock(recs[3].key)
    assert not store.put(recs[2])  # all locked: rejected
    assert store.stats().rejected_puts == 1 and store.stats().entries == 3


def test_a_put_that_cannot_fit_evicts_nothing(tmp_path):
    small = [make_record(seed=i) for i in range(3)]
    size = len(fmt.encode_record(small[0]).head) + small[0].nbytes
    store = disk(tmp_path, capacity=3 * size)
    for r in small:
        assert store.put(r)
    # Larger than the whole tier: refused, and the records it would have pushed out stay.
    assert not store.put(make_record(seed=9, num_tokens=200))
    assert all(store.contains(r.key) for r in small)
    # Room only by evicting a locked record: the unlocked ones stay too.
    store.lock(small[0].key)
    store.lock(small[1].key)
    assert not store.put(make_record(seed=10, num_tokens=120))
    assert store.contains(small[2].key) and store.path_of(small[2].key).exists()
    assert store.stats().evictions == 0 and store.stats().rejected_puts == 2


def test_startup_removes_stale_temp_files_only(tmp_path, record):
    store = disk(tmp_path)
    store.put(record)
    sub = store.path_of(record.key).parent
    stale = sub / f"{TMP_PREFIX}x.sglkv.1"
    young = sub / f"{TMP_PREFIX}y.sglkv.2"
    stale.write_bytes(b"partial")
    young.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    reopened = disk(tmp_path)
    assert not stale.exists() and young.exists()
    assert reopened.contains(record.key)
    assert reopened.stats().errors["leftover_tmp"] == 1


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def test_startup_removes_a_young_temp_file_of_a_dead_writer(tmp_path, record):
    store = disk(tmp_path)
    store.put(record)
    path = store.path_of(record.key)
    mine = path.parent / tmp_name(path)  # this (live) process: maybe a write in progress
    _, host, pid, _ = mine.name.rsplit(".", 3)
    killed = path.parent / mine.name.replace(f".{pid}.", f".{dead_pid()}.")
    live = path.parent / mine.name.replace(f".{pid}.", f".{os.getppid()}.")
    remote = path.parent / mine.name.replace(f".{host}.", ".another-host.").replace(
        f".{pid}.", f".{dead_pid()}."
    )
    for p in (mine, killed, live, remote):
        p.write_bytes(b"partial")
    reopened = disk(tmp_path)
    assert not killed.exists()
    assert mine.exists() and live.exists() and remote.exists()
    assert reopened.stats().errors["leftover_tmp"] == 1
    assert reopened.contains(record.key)


def test_abort_writes_stops_a_write_in_flight_and_refuses_later_ones(tmp_path, monkeypatch):
    kept, cut, later = (make_record(seed=i) for i in range(3))
    store = disk(tmp_path)
    assert store.put(kept)
    writing, aborted = threading.Event(), threading.Event()
    real_write = os.write

    def slow_write(fd, data):
        writing.set()
        aborted.wait(5)  # the abort lands while part of the file is written
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)
    errors: list[BaseException] = []

    def put() -> None:
        try:
            store.put(cut)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=put)
    t.start()
    assert writing.wait(5)
    store.abort_writes()
    aborted.set()
    t.join(5)
    monkeypatch.undo()
    assert len(errors) == 1 and isinstance(errors[0], WriteCancelled)
    assert store.writes_aborted
    assert not store.put(later)
    assert files(tmp_path) == [f"{kept.key[:2]}/{kept.key}.sglkv"]  # no temp file
    assert not store.contains(cut.key) and store.stats().entries == 1
    assert same_record(store.get(kept.key), kept)  # reads keep working


def test_a_file_under_the_wrong_name_is_not_served(tmp_path):
    a, b = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(a)
    store.put(b)
    # b's file replaced by a's bytes: the name says b, the header says a.
    store.path_of(b.key).write_bytes(store.path_of(a.key).read_bytes())
    assert store.get(b.key) is None
    assert store.stats().errors["corrupt"] == 1
    assert same_record(store.get(a.key), a)


def test_locks_nest_and_evict_reports_keys_and_bytes(tmp_path):
    a, b = make_record(seed=1), make_record(seed=2)
    store = disk(tmp_path)
    store.put(a)
    store.put(b)
    size = store.path_of(b.key).stat().st_size
    assert store.lock(a.key) and store.lock(a.key)
    store.unlock(a.key)
    store.unlock("0" * 64)  # not held: a no-op
    res = store.evict(10 * FILE_BYTES)
    assert res.keys == (b.key,) and res.freed_bytes == size
    assert not store.path_of(b.key).exists()
    store.unlock(a.key)
    assert store.evict(1).keys == (a.key,)
    s = store.stats()
    assert (s.entries, s.bytes_used, s.evictions, s.evicted_bytes) == (0, 0, 2, 2 * size)
    assert not store.lock(a.key) and files(tmp_path) == []
