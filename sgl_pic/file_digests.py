"""SHA-256 digests of large files, taken once per machine and reused while a file is
unchanged.

``FileDigests.digest`` keeps each digest in its cache directory beside the stat it was
taken at (size, mtime_ns, ctime_ns, inode, device) and serves it only while every one
still matches: a file rewritten in place changes its ctime, which no user-space call can
set back. Processes that ask for the same file at once (the ranks of one server, two
servers on one machine) take an exclusive lock on that entry: the first hashes, the
others wait and read its result. A cache directory that cannot be written is no error:
the digest is computed and returned, and the next process computes it again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

_BLOCK = 1 << 22
_ENTRY_VERSION = 1


class FileStat(NamedTuple):
    """What identifies one version of a file's bytes on this machine."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileStat:
        st = path.stat()  # follows links: the bytes a loader reads
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class FileDigests:
    """Digests of files by content, cached under ``cache_dir`` (None: no cache).

    Scheduler side, at start-up and on weight updates; safe to call from several
    processes at once. ``hashed`` counts the files this instance read in full."""

    def __init__(self, cache_dir: Path | None) -> None:
        self.cache_dir = cache_dir
        self.hashed = 0

    def digest(self, path: Path) -> str:
        """Hex SHA-256 of ``path``'s bytes (links followed). Raises OSError when the file
        cannot be read; never when the cache cannot be."""
        real = path.resolve()
        stat = FileStat.of(real)
        entry = self._entry(real)
        if entry is None:
            return self._hash(real)
        with _locked(entry.with_suffix(".lock")) as locked:
            cached = _read_entry(entry, real, stat)
            if cached is not None:
                return cached
            value = self._hash(real)
            if locked and FileStat.of(real) == stat:  # unchanged while it was read
                _write_entry(entry, real, stat, value)
            return value

    def _entry(self, real: Path) -> Path | None:
        if self.cache_dir is None:
            return None
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        name = hashlib.sha256(str(real).encode()).hexdigest()[:40]
        return self.cache_dir / f"{name}.json"

    def _hash(self, real: Path) -> str:
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
        self.hashed += 1
        return h.hexdigest()


@contextmanager
def _locked(lock_path: Path) -> Iterator[bool]:
    """Holds an exclusive lock on ``lock_path`` (True), or nothing when it cannot be
    opened (False): the caller then computes without sharing."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _read_entry(entry: Path, real: Path, stat: FileStat) -> str | None:
    """The cached digest when the entry names this file at this stat, else None (a
    missing, unreadable or malformed entry reads as none)."""
    try:
        data = json.loads(entry.read_text())
        ok = (
            data["v"] == _ENTRY_VERSION
            and data["path"] == str(real)
            and FileStat(*data["stat"]) == stat
        )
        value = str(data["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if ok and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value
    return None


def _write_entry(entry: Path, real: Path, stat: FileStat, value: str) -> None:
    payload = {"v": _ENTRY_VERSION, "path": str(real), "stat": list(stat), "sha256": value}
    try:
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".digest_")
    except OSError:
        return  # not cached: the next process computes it again
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, entry)  # readers see the whole entry or the old one
    except OSError:
        Path(tmp).unlink(missing_ok=True)
