"""``FileDigests``: a digest is taken once per machine and served only while the file's
bytes cannot have changed."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path

from sgl_pic.file_digests import FileDigests


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_digest_is_taken_once_and_served_from_the_cache(tmp_path: Path) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"abc" * 1000)
    cache = tmp_path / "cache"
    first = FileDigests(cache)
    assert first.digest(f) == sha(b"abc" * 1000) and first.hashed == 1
    second = FileDigests(cache)  # another process, a later launch
    assert second.digest(f) == sha(b"abc" * 1000) and second.hashed == 0


def test_a_file_rewritten_in_place_is_hashed_again(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 64)
    cache = tmp_path / "cache"
    FileDigests(cache).digest(f)
    st = f.stat()
    f.write_bytes(b"b" * 64)  # same size; mtime set back: only ctime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = FileDigests(cache)
    assert again.digest(f) == sha(b"b" * 64) and again.hashed == 1


def test_a_link_is_the_file_it_names(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(b"x" * 10)
    link = tmp_path / "model.safetensors"
    link.symlink_to(f)
    digests = FileDigests(tmp_path / "cache")
    assert digests.digest(link) == digests.digest(f) == sha(b"x" * 10)
    assert digests.hashed == 1


def test_a_broken_or_foreign_cache_entry_is_never_served(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"q" * 32)
    cache = tmp_path / "cache"
    FileDigests(cache).digest(f)
    (entry,) = cache.glob("*.json")
    for text in ("{", '{"v": 1}', entry.read_text().replace(sha(b"q" * 32), "0" * 64)[:-3]):
        entry.write_text(text)
        d = FileDigests(cache)
        assert d.digest(f) == sha(b"q" * 32) and d.hashed == 1


def test_an_unwritable_cache_still_answers(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"z")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    d = FileDigests(blocker / "cache")
    assert d.digest(f) == sha(b"z") and d.digest(f) == sha(b"z") and d.hashed == 2
    assert FileDigests(None).digest(f) == sha(b"z")


def _digest_in_child(args: tuple[str, str]) -> tuple[str, int]:
    d = FileDigests(Path(args[1]))
    return d.digest(Path(args[0])), d.hashed


def test_processes_asking_at_once_hash_the_file_once(tmp_path: Path) -> None:
    """The ranks of one server start together: one hashes, the others wait for it."""
    f = tmp_path / "big.safetensors"
    f.write_bytes(os.urandom(1 << 24))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        out = pool.map(_digest_in_child, [(str(f), str(tmp_path / "cache"))] * 4)
    assert {d for d, _ in out} == {sha(f.read_bytes())}
    assert sum(n for _, n in out) == 1
