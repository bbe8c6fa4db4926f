"""The disk tier at rest: readable by its owner only, and loud when it is not."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from tests.store.helpers import MODEL, OTHER_MODEL, make_record


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: modes must not depend on the caller's."""
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_fresh_tier_and_its_records_are_private(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "cache" / "chunks"
    store = DiskStore(DiskStoreConfig(str(root), 1 << 22), MODEL)
    rec = make_record()
    assert store.put(rec)
    path = store.path_of(rec.key)
    assert mode(root) == 0o700
    assert mode(path.parent) == 0o700
    assert mode(path) == 0o600
    assert store.at_rest.ok


def test_a_looser_tier_is_reported_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "chunks"
    store = DiskStore(DiskStoreConfig(str(root), 1 << 22), MODEL)
    rec = make_record()
    assert store.put(rec)
    os.chmod(root, 0o755)
    os.chmod(store.path_of(rec.key), 0o644)
    with caplog.at_level(logging.WARNING, logger="sgl_pic.store.private"):
        again = DiskStore(DiskStoreConfig(str(root), 1 << 22), MODEL)
    assert again.at_rest.root_mode is not None and again.at_rest.loose_records == 1
    assert again.contains(rec.key)  # still served: the operator decides
    text = caplog.text
    assert "0755" in text and "1 record(s)" in text and f"chmod -R go-rwx {root}" in text


def test_loose_records_of_another_model_or_version_are_reported_too(tmp_path: Path) -> None:
    # Records this server skips (an older key version, another model) hold prompt tokens
    # all the same: their modes count.
    root = tmp_path / "chunks"
    other = DiskStore(DiskStoreConfig(str(root), 1 << 22), OTHER_MODEL)
    rec = make_record(model=OTHER_MODEL)
    assert other.put(rec)
    os.chmod(other.path_of(rec.key), 0o644)
    mine = DiskStore(DiskStoreConfig(str(root), 1 << 22), MODEL)
    assert not mine.contains(rec.key)
    assert mine.at_rest.loose_records == 1
