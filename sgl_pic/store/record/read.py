"""Reading a chunk file: opened only when it is a regular file (never waiting on a FIFO
or acting on a device), its header parsed and checked against what the caller expects,
its payload read through a read-only mmap with every touched block verified against its
checksum before a byte is returned. Results are fresh copies, valid after the file is
closed or deleted. Safe on any thread; each reader owns its descriptor and map.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from sgl_pic.store.base import DTYPES, ChunkKV, layer_offsets, normalize_indices
from sgl_pic.store.errors import CorruptRecordError
from sgl_pic.store.record.header import (
    DIGEST_BYTES,
    PREFIX_BYTES,
    RecordHeader,
    check_expectations,
    parse_header,
)


class NotRegularFileError(CorruptRecordError):
    """The path holds no regular file (a FIFO, socket, device node, directory or symlink):
    never a record this store wrote, and never opened for reading, since opening a FIFO
    waits for a writer and opening a device can have effects of its own."""


# Opening must never wait: O_NONBLOCK makes a FIFO's open return at once instead of waiting
# for a writer, and O_NOFOLLOW refuses a symlink at the record's path (the store never
# writes one; it may lead anywhere, e.g. to /dev/zero).
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# What os.open reports for a path that is no regular file: a symlink (O_NOFOLLOW), a
# socket, a device without a driver.
_NOT_REGULAR_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.ENODEV})


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at ``path`` (blocking mode) and its
    stat; the caller closes it. Never blocks in ``open``: anything but a regular file
    raises ``NotRegularFileError`` without being read. OSError for the rest (missing,
    permission denied)."""
    # Checked before opening because opening a device node may act on the device (a
    # tape rewinds); the fstat below closes the race with a swap after this check.
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise NotRegularFileError(f"{path.name} is not a regular file")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in _NOT_REGULAR_ERRNOS:
            raise NotRegularFileError(f"{path.name} is not a regular file") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{path.name} is not a regular file")
        # Regular files ignore O_NONBLOCK; cleared so the descriptor reads plainly.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_header(
    path: Path,
    model_digest: str | None = None,
    key: str | None = None,
    token_ids: Sequence[int] | None = None,
) -> RecordHeader:
    """Parse and check only the prefix and header (no payload checksums): cheap enough
    for rebuilding an index at start-up. Raises a StoreError subclass (``NotRegularFileError``
    for anything but a regular file) or OSError."""
    fd, st = open_regular(path)
    with open(fd, "rb") as f:
        header = parse_header(f.read(PREFIX_BYTES), f.read, st.st_size, model_digest)
    check_expectations(header, model_digest, key, token_ids)
    return header


class RecordFile:
    """An open, header-checked chunk file, read through a read-only mmap.

    Payload bytes are verified against their block checksums as they are read; every
    returned tensor is a fresh copy, so results stay valid after ``close`` and after
    the file is deleted. Use as a context manager."""

    def __init__(
        self,
        path: Path,
        model_digest: str | None = None,
        key: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        fd, st = open_regular(path)
        try:
            size = st.st_size
            if size < PREFIX_BYTES:
                prefix = os.pread(fd, PREFIX_BYTES, 0)
                parse_header(prefix, lambda n: b"", size)
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            mm = self._mm
            pos = PREFIX_BYTES
            self.header = parse_header(
                mm[:PREFIX_BYTES], lambda n: mm[pos : pos + n], size, model_digest
            )
            check_expectations(self.header, model_digest, key, token_ids)
        except BaseException:
            self._mm.close()
            raise

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # A numpy view may still be alive on an error path; GC closes the map later.
        with contextlib.suppress(BufferError):
            self._mm.close()

    def _area(self, layer_offset: int, which: int) -> np.ndarray:
        """# [num_tokens, row_bytes] uint8 view of K (which=0) or V (which=1)."""
        h = self.header
        start = h.data_offset + (2 * layer_offset + which) * h.layer_bytes
        flat = np.frombuffer(self._mm, dtype=np.uint8, count=h.layer_bytes, offset=start)
        return flat.reshape(h.num_tokens, h.row_bytes)

    def _verify(self, area: np.ndarray, sums: bytes, blocks: np.ndarray, what: str) -> None:
        bt = self.header.block_tokens
        for b in blocks.tolist():
            got = hashlib.sha256(area[b * bt : (b + 1) * bt]).digest()
            if got != sums[b * DIGEST_BYTES : (b + 1) * DIGEST_BYTES]:
                raise CorruptRecordError(f"checksum mismatch in {what}, token block {b}")

    def read_layers(
        self,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices # [n] int64 sorted, k, v # [len(layers), n, heads, head_dim]):
        copies of just those rows, each touched block verified first."""
        h = self.header
        offsets = layer_offsets(range(h.layer_start, h.layer_start + h.num_layers), layers)
        idx = normalize_indices(token_indices, h.num_tokens)
        idx_np = idx.numpy()
        blocks = np.unique(idx_np // h.block_tokens)
        out = np.empty((2, len(offsets), idx_np.size, h.row_bytes), dtype=np.uint8)
        for i, lo in enumerate(offsets):
            for which, sums in ((0, h.k_sums[lo]), (1, h.v_sums[lo])):
                area = self._area(lo, which)
                self._verify(area, sums, blocks, f"layer {lo + h.layer_start}")
                np.take(area, idx_np, axis=0, out=out[which, i])
                del area
        dtype = DTYPES[h.dtype]
        shape = (len(offsets), idx_np.size, h.num_kv_heads, h.head_dim)
        kv = torch.from_numpy(out).view(dtype)
        return idx, kv[0].reshape(shape), kv[1].reshape(shape)

    def read_record(self) -> ChunkKV:
        """The whole record, every block verified."""
        h = self.header
        _, k, v = self.read_layers(range(h.layer_start, h.layer_start + h.num_layers))
        return ChunkKV(
            key=h.key,
            model_digest=h.model_digest,
            token_ids=h.token_ids,
            k=k,
            v=v,
            ranking=h.ranking,
            layer_start=h.layer_start,
            namespace=h.namespace,
            context_contents=h.context_contents,
        )


def read_record(
    path: Path,
    model_digest: str | None = None,
    key: str | None = None,
    token_ids: Sequence[int] | None = None,
) -> ChunkKV:
    """The whole record at ``path``, fully verified. Raises a StoreError subclass for a
    bad file (``NotRegularFileError`` for anything but a regular file), OSError for one
    that cannot be opened."""
    with RecordFile(path, model_digest, key, token_ids) as f:
        return f.read_record()
