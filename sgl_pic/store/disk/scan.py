"""The disk tier's start-up scan: every record file under the root, its header read and
checked, becomes an index entry; what is not a sound record of this model and KV layout
is counted (and deleted when ours and broken: ``disk.files``), leftover temp files of
killed writers are removed (counted "leftover_tmp"), and record files readable by others
are counted for ``private.report``. Runs once, in ``DiskStore.__init__``.
"""

from __future__ import annotations

import os
import stat
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from sgl_pic.store.base import RecordLayout
from sgl_pic.store.disk.files import count_bad, remove_stale_tmp
from sgl_pic.store.errors import CorruptRecordError, StoreError
from sgl_pic.store.private import is_loose
from sgl_pic.store.record.header import SUFFIX, file_name
from sgl_pic.store.record.read import read_header
from sgl_pic.store.record.write import TMP_PREFIX


class FoundRecord(NamedTuple):
    """A sound record file: its mtime (recency survives a restart approximately), key,
    size, namespace and content digest (deletions and caps work on earlier runs' too)."""

    mtime: float
    key: str
    size: int
    namespace: str
    content: str


class DiskScan(NamedTuple):
    """found: the sound records, oldest first; loose_records: record files whose mode
    lets others read them (any model's or version's: each holds prompt tokens)."""

    found: list[FoundRecord]
    loose_records: int


def scan_root(
    root: Path,
    model_digest: str,
    layout: RecordLayout | None,
    stale_tmp_seconds: float,
    errors: Counter[str],
) -> DiskScan:
    """Scans ``root``'s ``<2 hex>/`` subdirectories (never through a link: a bad file
    found there would be deleted in its target), counting what it drops in ``errors``."""
    found: list[FoundRecord] = []
    loose = 0
    now = time.time()
    for sub in sorted(root.iterdir()):
        if sub.is_symlink() or not sub.is_dir() or len(sub.name) != 2:
            continue
        try:
            entries = sorted(sub.iterdir())
        except OSError:
            # An unlistable subdirectory (e.g. no permission) holds nothing we can
            # serve; the store starts without it rather than not at all.
            errors["unreadable"] += 1
            continue
        for path in entries:
            if path.name.startswith(TMP_PREFIX):
                if remove_stale_tmp(path, now, stale_tmp_seconds):
                    errors["leftover_tmp"] += 1
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                # Every record file's mode counts, this server's or not (an older
                # version's, another model's): each holds prompt tokens. lstat: never
                # a link's target.
                st = os.lstat(path)
                loose += stat.S_ISREG(st.st_mode) and is_loose(st.st_mode)
                header = read_header(path, model_digest)
                if layout is not None:
                    layout.check_header(header)
                if path.name != file_name(header.key) or sub.name != path.name[:2]:
                    raise CorruptRecordError(f"{path.name} holds key {header.key[:12]}")
            except StoreError as exc:
                count_bad(exc, path, errors)
                continue
            except OSError:
                errors["unreadable"] += 1
                continue
            found.append(
                FoundRecord(st.st_mtime, header.key, st.st_size, header.namespace, header.content)
            )
    return DiskScan(sorted(found), loose)
