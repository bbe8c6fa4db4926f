"""What the disk tier does with files that are not sound records: which error kind each
bad file or failed read counts as and whether the file is deleted, how a bad path is
removed without following it anywhere, and which leftover temp files of killed writers
may go. Counts go into the caller's error counter (the caller holds its lock)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from sgl_pic.store.errors import (
    BadMagicError,
    CorruptRecordError,
    ForeignModelError,
    LayoutMismatchError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from sgl_pic.store.record.read import NotRegularFileError
from sgl_pic.store.record.write import TmpOwner, is_local_owner, tmp_owner

# Counted as "enospc": the device is full, a quota is spent, or the process's file-size
# limit is reached; each means this record cannot be written now.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

# Of those, the ones that mean the file system is full, so that evicting our own files
# makes room. EFBIG is a per-file limit (RLIMIT_FSIZE, the file system's largest file):
# evicting other records cannot lift it, so it lowers no capacity.
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})

# (error kind in stats, delete the file?). Foreign and newer files may belong to another
# model or a newer binary sharing the directory, so they are skipped, not deleted. The
# first matching class counts, so subclasses come before their bases.
BAD_FILE: Mapping[type[StoreError], tuple[str, bool]] = MappingProxyType(
    {
        NotRegularFileError: ("not_regular", True),
        # Our model's fingerprint, yet not our pool's KV layout: no server of this fingerprint
        # can use it, so it goes (its key stays free for the recomputed chunk).
        LayoutMismatchError: ("layout_mismatch", True),
        BadMagicError: ("corrupt", True),
        CorruptRecordError: ("corrupt", True),
        TruncatedRecordError: ("truncated", True),
        TokenMismatchError: ("token_mismatch", True),
        ForeignModelError: ("foreign_model", False),
        UnsupportedFormatError: ("newer_format", False),
    }
)


def bad_file_kind(exc: StoreError) -> tuple[str, bool]:
    """(error kind, delete the file?) of a bad record file."""
    return next((v for cls, v in BAD_FILE.items() if isinstance(exc, cls)), ("corrupt", True))


def remove_bad(path: Path) -> bool:
    """Remove what sits at a bad record's path, never anything it leads to: a symlink
    goes, its target stays; a directory goes only when empty (its contents are not ours
    to judge), else stays, uncounted, to be skipped again. False when unlinking failed."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            with contextlib.suppress(OSError):
                path.rmdir()
            return True
        path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def remove_stale_tmp(path: Path, now: float, stale_seconds: float) -> bool:
    """Remove a temp file older than ``stale_seconds`` or whose writer (named in it, on
    this host) has ended; True when removed."""
    try:
        owner = tmp_owner(path.name)
        old = now - path.stat().st_mtime > stale_seconds
        if old or (owner is not None and _writer_is_gone(owner)):
            path.unlink()
            return True
    except OSError:
        pass
    return False


def _writer_is_gone(owner: TmpOwner) -> bool:
    """Whether the process that named a temp file has ended (checked on this host only;
    another host's or a live process's file is left to the age rule)."""
    if not is_local_owner(owner) or owner.pid == os.getpid():
        return False
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # e.g. EPERM: the process exists under another user
    return False


def count_bad(exc: StoreError, path: Path, errors: Counter[str]) -> None:
    """Counts a bad record file in ``errors`` by its kind and removes it when that kind
    is deleted (``BAD_FILE``); a failed removal counts as "unlink_error"."""
    kind, delete = bad_file_kind(exc)
    errors[kind] += 1
    if delete and not remove_bad(path):
        errors["unlink_error"] += 1


def count_failed_read(exc: Exception, path: Path, errors: Counter[str]) -> None:
    """Counts a read of the file at ``path`` that failed with ``exc``: "vanished" when it
    is gone, its bad-file kind for a ``StoreError`` (``count_bad``), else "unreadable"
    (an I/O error, or a file emptied under its mmap), and then the file goes too: its
    index entry is dropped, and left there it would hold disk space no accounting sees
    and no eviction frees, until a restart."""
    if isinstance(exc, FileNotFoundError):
        errors["vanished"] += 1
    elif isinstance(exc, StoreError):
        count_bad(exc, path, errors)
    else:
        errors["unreadable"] += 1
        if not remove_bad(path):
            errors["unlink_error"] += 1
