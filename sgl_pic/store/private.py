"""Cache files readable by their owner only.

Every record holds its chunk's token ids (a document, a tool output, a message), so the
disk tier's directory is created 0700 and its records 0600, whatever the umask; a
directory or records found looser at start-up (made by an older version, or by hand) are
reported once, with the command that tightens them. They are not changed: an operator
may have opened them on purpose.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# Group and other permission bits: any of them set makes a path readable (or listable,
# or writable) by other local users.
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


class LooseModes(NamedTuple):
    """What a start-up check found: the root's mode when looser than 0700 (else None) and
    how many records under it are looser than 0600."""

    root_mode: int | None
    loose_records: int

    @property
    def ok(self) -> bool:
        return self.root_mode is None and self.loose_records == 0


def make_private_dir(path: Path) -> None:
    """Creates ``path`` (and missing parents) if needed; a directory created here is 0700
    (a chmod after mkdir, since mkdir's mode passes through the umask)."""
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    os.chmod(path, PRIVATE_DIR_MODE)


def is_loose(mode: int) -> bool:
    """Whether ``mode`` (an ``st_mode``) gives group or others any access."""
    return bool(mode & _OTHERS)


def report(root: Path, found: LooseModes) -> None:
    """One warning naming what is readable by others, and how to fix it."""
    if found.ok:
        return
    parts = []
    if found.root_mode is not None:
        parts.append(f"the directory is {stat.S_IMODE(found.root_mode):04o}")
    if found.loose_records:
        parts.append(f"{found.loose_records} record(s) are readable by other users")
    logger.warning(
        "sgl_pic: the disk chunk tier at %s holds prompt text and %s; "
        "restrict it with: chmod -R go-rwx %s",
        root,
        " and ".join(parts),
        root,
    )
