"""The disk tier against whatever may sit at a record's path: FIFOs, sockets, devices,
directories and symlinks never block or crash it, and a header that fails its checks
when peeked at is dropped, so the chunk can be stored afresh instead of missing forever."""

import contextlib
import os
import pathlib
import random
import shutil
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.format import NotRegularFileError, read_header, read_record
from tests.store.helpers import MODEL, make_record, same_record

# Far above any sound call's time here; a call still running after it is blocked.
TIMEOUT_S = 10.0


def disk(root: Path, capacity: int = 1 << 24) -> DiskStore:
    return DiskStore(DiskStoreConfig(root=str(root), capacity_bytes=capacity), MODEL)


def within(fn: Callable[[], Any], fifo: Path | None = None) -> Any:
    """``fn()``'s result, failing the test (instead of hanging it) when the call is still
    running after TIMEOUT_S; a reader stuck opening ``fifo`` is then let go."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        if fifo is not None:
            # Opening the write end completes the reader's open; closing it gives EOF.
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(TIMEOUT_S)
        pytest.fail(f"the call blocked for over {TIMEOUT_S}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def two_records(root: Path) -> tuple[DiskStore, Any, Any, Path]:
    """A store holding a good and a (soon) bad record, and the bad one's path."""
    good, bad = make_record(seed=1), make_record(seed=2)
    store = disk(root)
    assert store.put(good) and store.put(bad)
    return store, good, bad, store.path_of(bad.key)


def make_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def make_socket(path: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    """A listening unix socket bound at ``path`` (relative, as socket paths are short)."""
    path.unlink(missing_ok=True)
    monkeypatch.chdir(path.parent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path.name)
    sock.listen()
    return sock


def errors(store: DiskStore, kind: str) -> int:
    return store.stats().errors.get(kind, 0)


def test_open_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo.sglkv"
    os.mkfifo(fifo)
    link = tmp_path / "link.sglkv"
    link.symlink_to("/dev/zero")
    for path in (fifo, link, tmp_path):
        with pytest.raises(NotRegularFileError):
            within(lambda p=path: read_header(p))
        with pytest.raises(NotRegularFileError):
            within(lambda p=path: read_record(p))


def test_fifo_at_startup_is_skipped_without_waiting(tmp_path):
    store, good, bad, path = two_records(tmp_path)
    make_fifo(path)
    reopened = within(lambda: disk(tmp_path), path)
    assert reopened.contains(good.key) and not reopened.contains(bad.key)
    assert errors(reopened, "not_regular") == 1 and not os.path.lexists(path)
    assert reopened.stats().bytes_used == reopened.path_of(good.key).stat().st_size
    assert reopened.put(bad) and same_record(reopened.get(bad.key, bad.token_ids), bad)


@pytest.mark.parametrize("call", ["peek_header", "get", "get_layers"])
def test_fifo_at_read_time_is_a_counted_miss_without_waiting(tmp_path, call):
    store, good, bad, path = two_records(tmp_path)
    make_fifo(path)
    reads: dict[str, Callable[[], Any]] = {
        "peek_header": lambda: store.peek_header(bad.key, bad.token_ids),
        "get": lambda: store.get(bad.key, bad.token_ids),
        "get_layers": lambda: store.get_layers(bad.key, range(0, 1)),
    }
    assert within(reads[call], path) is None
    assert not store.contains(bad.key) and errors(store, "not_regular") == 1
    assert not os.path.lexists(path)
    assert same_record(store.get(good.key, good.token_ids), good)
    # The chunk is stored afresh on the next miss.
    assert store.put(bad) and same_record(store.get(bad.key, bad.token_ids), bad)


def test_peek_at_a_fifo_does_not_wait(tmp_path):
    store, _, bad, path = two_records(tmp_path)
    make_fifo(path)
    assert within(lambda: store.peek(bad.key), path) is None


def test_socket_at_a_record_path_is_skipped_and_dropped(tmp_path, monkeypatch):
    store, good, bad, path = two_records(tmp_path)
    with make_socket(path, monkeypatch):
        reopened = within(lambda: disk(tmp_path))
        assert reopened.contains(good.key) and not reopened.contains(bad.key)
        assert errors(reopened, "not_regular") == 1 and not os.path.lexists(path)
    with make_socket(path, monkeypatch):
        assert within(lambda: store.peek_header(bad.key)) is None
        assert not store.contains(bad.key) and errors(store, "not_regular") == 1
        assert not os.path.lexists(path)


def test_device_node_at_a_record_path_is_never_opened(tmp_path):
    store, good, bad, path = two_records(tmp_path)
    path.unlink()
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    reopened = within(lambda: disk(tmp_path))
    assert reopened.contains(good.key) and not reopened.contains(bad.key)
    assert errors(reopened, "not_regular") == 1 and not os.path.lexists(path)


@pytest.mark.parametrize("target", ["/dev/zero", "a copy of the record"])
def test_symlink_at_a_record_path_is_dropped_and_its_target_kept(tmp_path, target):
    root = tmp_path / "disk"
    store, good, bad, path = two_records(root)
    dest = Path(target)
    if target != "/dev/zero":
        dest = tmp_path / "elsewhere.sglkv"
        shutil.copy(path, dest)
    kept = dest.read_bytes() if dest.is_file() else None
    path.unlink()
    path.symlink_to(dest)
    # At start-up: skipped, the link removed, never what it points to.
    reopened = within(lambda: disk(root))
    assert reopened.contains(good.key) and not reopened.contains(bad.key)
    assert errors(reopened, "not_regular") == 1 and not os.path.lexists(path)
    assert dest.exists() and (kept is None or dest.read_bytes() == kept)
    # At read time (the first store still indexes the key): the same.
    path.symlink_to(dest)
    assert within(lambda: store.get(bad.key, bad.token_ids)) is None
    assert not store.contains(bad.key) and errors(store, "not_regular") == 1
    assert not os.path.lexists(path)
    assert dest.exists() and (kept is None or dest.read_bytes() == kept)


def test_directory_at_a_record_path(tmp_path):
    store, good, bad, path = two_records(tmp_path)
    path.unlink()
    path.mkdir()
    (path / "not-ours").write_bytes(b"x")
    # A directory with contents is skipped at start-up and left as it is...
    reopened = within(lambda: disk(tmp_path))
    assert reopened.contains(good.key) and not reopened.contains(bad.key)
    assert errors(reopened, "not_regular") == 1 and errors(reopened, "unlink_error") == 0
    assert (path / "not-ours").exists()
    # ...an empty one is removed, so the record can be written there again.
    (path / "not-ours").unlink()
    assert within(lambda: store.peek_header(bad.key, bad.token_ids)) is None
    assert not store.contains(bad.key) and errors(store, "not_regular") == 1
    assert not os.path.lexists(path)
    assert store.put(bad) and same_record(store.get(bad.key, bad.token_ids), bad)


def test_an_unlistable_subdirectory_does_not_stop_startup(tmp_path, monkeypatch):
    store, good, bad, path = two_records(tmp_path)
    assert good.key[:2] != bad.key[:2]
    real_iterdir = pathlib.Path.iterdir

    def iterdir(self: Path) -> Any:
        # As if the directory were chmod 000 for a non-root user (tests may run as root).
        if self == path.parent:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", iterdir)
    reopened = disk(tmp_path)
    assert reopened.contains(good.key) and not reopened.contains(bad.key)
    assert errors(reopened, "unreadable") == 1


def _damage(store: DiskStore, path: Path, how: str, other_key: str) -> None:
    size = path.stat().st_size
    if how == "truncated to half":
        os.truncate(path, size // 2)
    elif how == "random bytes":
        path.write_bytes(random.Random(0).randbytes(size))
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "another record's bytes":
        path.write_bytes(store.path_of(other_key).read_bytes())
    elif how == "a directory":
        path.unlink()
        path.mkdir()
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "kind"),
    [
        ("truncated to half", "truncated"),
        ("random bytes", "corrupt"),
        ("emptied", "truncated"),
        ("another record's bytes", "corrupt"),
        ("a directory", "not_regular"),
    ],
)
def test_a_bad_header_seen_by_peek_is_dropped_and_stored_afresh(tmp_path, how, kind):
    store, good, bad, path = two_records(tmp_path)
    _damage(store, path, how, good.key)
    misses = store.stats().misses
    assert store.peek_header(bad.key, bad.token_ids) is None
    s = store.stats()
    assert s.errors.get(kind) == 1 and sum(s.errors.values()) == 1
    assert s.misses == misses  # a peek counts no access, a failed one neither
    assert not store.contains(bad.key) and not os.path.lexists(path)
    assert (s.entries, s.bytes_used) == (1, store.path_of(good.key).stat().st_size)
    # The next miss stores the chunk again, and it is served.
    assert store.put(bad)
    header = store.peek_header(bad.key, bad.token_ids)
    assert header is not None and header.key == bad.key
    assert same_record(store.get(bad.key, bad.token_ids), bad)
    assert same_record(store.get(good.key, good.token_ids), good)
    assert store.stats().errors.get(kind) == 1


def test_peek_with_other_tokens_drops_the_key_like_get(tmp_path, record):
    store = disk(tmp_path)
    store.put(record)
    assert store.peek_header(record.key, [t + 1 for t in record.token_ids]) is None
    assert errors(store, "token_mismatch") == 1 and not store.contains(record.key)
    assert not store.path_of(record.key).exists()


def test_peek_at_a_vanished_file_forgets_the_key(tmp_path, record):
    store = disk(tmp_path)
    store.put(record)
    store.path_of(record.key).unlink()
    assert store.peek_header(record.key) is None
    assert errors(store, "vanished") == 1 and not store.contains(record.key)
    assert store.put(record) and store.peek_header(record.key) is not None


def test_startup_never_indexes_or_deletes_through_a_linked_subdirectory(tmp_path):
    # A bad file found at start-up is deleted: through a link that would be in its target.
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    rec = make_record(seed=3)
    store = disk(root)
    assert store.put(rec)
    sub = store.path_of(rec.key).parent
    elsewhere.mkdir()
    victim = elsewhere / store.path_of(rec.key).name
    victim.write_bytes(b"not a record")
    shutil.rmtree(sub)
    sub.symlink_to(elsewhere, target_is_directory=True)
    again = disk(root)
    assert again.stats().entries == 0 and victim.read_bytes() == b"not a record"
