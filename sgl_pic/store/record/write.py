"""Writing a chunk file atomically: a temp file beside the target (named after its
writer, so a later start-up can tell a dead writer's leftover from a live write), written
in slices a cancel can stop, fsynced, renamed over the target, then the directory
fsynced. A crash leaves the whole file or none. Called by the tiers' writer threads.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid
from pathlib import Path
from typing import NamedTuple

from sgl_pic.store.base import ChunkKV
from sgl_pic.store.record.encode import EncodedRecord, encode_record

TMP_PREFIX = ".tmp-"
# write_record hands at most this many bytes to one os.write, so a cancel is seen promptly.
_WRITE_SLICE = 8 << 20


class WriteCancelled(Exception):
    """``write_record`` stopped because its ``cancel`` event was set; it left no file.

    Not an OSError on purpose: a cancelled write is a shutdown decision, not an I/O error.
    """


class TmpOwner(NamedTuple):
    """Who wrote a temp file: the host name (sanitised) and the writer's process id."""

    host: str
    pid: int


def _host_tag() -> str:
    # Dots separate the fields of a temp name, so the host name keeps none.
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def tmp_name(path: Path) -> str:
    """A unique temp name beside ``path`` that records its writer (host and pid), so a
    later start-up can tell a dead writer's leftover from a live write in progress."""
    return f"{TMP_PREFIX}{path.name}.{_host_tag()}.{os.getpid()}.{uuid.uuid4().hex}"


def tmp_owner(name: str) -> TmpOwner | None:
    """The writer recorded in a temp file's name, or None (not a temp name, or one
    written by an older version that did not record it)."""
    if not name.startswith(TMP_PREFIX):
        return None
    parts = name[len(TMP_PREFIX) :].split(".")
    # <64 hex>.sglkv.<host>.<pid>.<uuid hex>
    if len(parts) != 5 or not parts[3].isdigit():
        return None
    return TmpOwner(parts[2], int(parts[3]))


def is_local_owner(owner: TmpOwner) -> bool:
    """Whether ``owner`` names this host, where its pid can be checked."""
    return owner.host == _host_tag()


def write_record(
    path: Path,
    record: ChunkKV | EncodedRecord,
    block_tokens: int = 32,
    cancel: threading.Event | None = None,
) -> int:
    """Write ``record`` to ``path`` atomically; returns the file size.

    A temp file in the same directory (named by ``tmp_name``) is written, fsynced and
    renamed over ``path``, then the directory is fsynced, so a crash leaves either the
    whole file or none (plus, after a kill, a temp file that start-up removes). On any
    error the temp file is removed and the error re-raised (OSError for I/O, e.g.
    ENOSPC). ``cancel``, when set before the rename, stops the write the same way and
    raises ``WriteCancelled``; once renamed the file is complete and stays."""
    enc = record if isinstance(record, EncodedRecord) else encode_record(record, block_tokens)
    head, areas = enc.head, enc.areas

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise WriteCancelled(f"write of {path.name} cancelled")

    check()
    tmp = path.parent / tmp_name(path)
    # Owner only: a record holds its chunk's token ids (``sgl_pic.store.private``).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            for buf in [head, *areas]:
                view = memoryview(buf).cast("B")
                while view.nbytes:
                    check()
                    view = view[os.write(fd, view[:_WRITE_SLICE]) :]
            check()
            os.fsync(fd)
        finally:
            os.close(fd)
        check()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        _fsync_dir(path.parent)
    except BaseException:
        # The rename may not be durable; the caller will not index the file, so it must
        # not linger to be indexed after a restart either.
        path.unlink(missing_ok=True)
        raise
    return enc.size


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
