"""The on-disk chunk file: a checksummed msgpack header, then raw per-layer tensor bytes.

Layout (all integers little-endian):

    offset 0   magic        8 bytes  b"SGLPICKV"
    offset 8   version      uint32   FORMAT_VERSION of the writer
    offset 12  header_len   uint32   bytes of the msgpack header
    offset 16  header_sha   32 bytes SHA-256 of the header bytes
    offset 48  header       msgpack map (see ``RecordHeader``)
    data_offset = header end rounded up to 4096 (page aligned, so mmap reads of one
                  layer touch only that layer's pages)
    payload    for each layer l of the record, in order:
                   K[l]  num_tokens * row_bytes   (row = one token: heads * head_dim)
                   V[l]  num_tokens * row_bytes
    file size  = data_offset + 2 * num_layers * num_tokens * row_bytes, exactly

The 48-byte prefix is fixed for every version, so a reader always recognises a newer
file before parsing its header. Checksums are SHA-256 per (layer, K or V, block of
``block_tokens`` tokens): a sparse read verifies just the blocks it touches and still
never returns an unverified byte. Nothing is pickled; tensors go through numpy buffers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import socket
import stat
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from sgl_pic.store.base import (
    DTYPES,
    ChunkKV,
    check_key,
    check_namespace,
    hash_token_ids,
    layer_offsets,
    normalize_indices,
)
from sgl_pic.store.errors import (
    BadMagicError,
    CorruptRecordError,
    ForeignModelError,
    RecordShapeError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)

MAGIC = b"SGLPICKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII32s")
PREFIX_BYTES = _PREFIX.size  # 48
ALIGN = 4096
DIGEST_BYTES = 32
# A header larger than this is a corrupt length field, not a real chunk.
MAX_HEADER_BYTES = 64 << 20
SUFFIX = ".sglkv"
TMP_PREFIX = ".tmp-"
# write_record hands at most this many bytes to one os.write, so a cancel is seen promptly.
_WRITE_SLICE = 8 << 20


class WriteCancelled(Exception):
    """``write_record`` stopped because its ``cancel`` event was set; it left no file.

    Not an OSError on purpose: a cancelled write is a shutdown decision, not an I/O error.
    """


class NotRegularFileError(CorruptRecordError):
    """The path holds no regular file (a FIFO, socket, device node, directory or symlink):
    never a record this store wrote, and never opened for reading, since opening a FIFO
    waits for a writer and opening a device can have effects of its own."""


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


@dataclass(frozen=True, eq=False)
class RecordHeader:
    """The parsed header of one chunk file.

    ranking:  # [num_tokens] float32 or None.
    k_sums / v_sums: per layer, the concatenated SHA-256 digests of its blocks.
    namespace: the record's isolation namespace (``ChunkKV.namespace``); "" in files
               written before it was kept.
    tombstones_seen: in the shared store, how many deletion tombstones its writer had
               seen (``sgl_pic.store.tombstones``): tombstones numbered from it on apply
               to it. 0 when absent (older writers, local files): every tombstone
               applies. An optional field, ignored by older readers, which know no
               tombstones anyway: no format version change.
    """

    version: int
    key: str
    model_digest: str
    dtype: str
    layer_start: int
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    token_ids: tuple[int, ...]
    token_ids_hash: str
    ranking: torch.Tensor | None
    block_tokens: int
    k_sums: tuple[bytes, ...]
    v_sums: tuple[bytes, ...]
    data_offset: int
    namespace: str = ""
    tombstones_seen: int = 0

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of K (or V) of one layer."""
        return self.num_tokens * self.row_bytes

    @property
    def payload_bytes(self) -> int:
        return 2 * self.num_layers * self.layer_bytes

    @property
    def file_size(self) -> int:
        return self.data_offset + self.payload_bytes

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_tokens)


def file_name(key: str) -> str:
    """The file name of a key: only its hex digest, never request content."""
    return check_key(key) + SUFFIX


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """# [...] any dtype -> a flat uint8 numpy view of its contiguous CPU bytes."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _block_sums(area: np.ndarray, row_bytes: int, block_tokens: int) -> bytes:
    step = row_bytes * block_tokens
    return b"".join(hashlib.sha256(area[i : i + step]).digest() for i in range(0, area.size, step))


def encode_header(
    record: ChunkKV, block_tokens: int, tombstones_seen: int = 0
) -> tuple[bytes, list[np.ndarray]]:
    """The full prefix + header + padding bytes, and the payload areas in file order.
    ``tombstones_seen``: see ``RecordHeader`` (written only when non-zero)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    row = record.row_bytes
    areas: list[np.ndarray] = []
    k_sums: list[bytes] = []
    v_sums: list[bytes] = []
    for layer in range(record.num_layers):
        k_area, v_area = _tensor_bytes(record.k[layer]), _tensor_bytes(record.v[layer])
        k_sums.append(_block_sums(k_area, row, block_tokens))
        v_sums.append(_block_sums(v_area, row, block_tokens))
        areas += [k_area, v_area]
    ranking = (
        None
        if record.ranking is None
        else _tensor_bytes(record.ranking.to(torch.float32)).tobytes()
    )
    header: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "key": record.key,
        "model": record.model_digest,
        "dtype": record.dtype_name,
        "layer_start": record.layer_start,
        "num_layers": record.num_layers,
        "num_tokens": record.num_tokens,
        "num_kv_heads": int(record.k.shape[2]),
        "head_dim": int(record.k.shape[3]),
        "token_ids": list(record.token_ids),
        "token_ids_hash": hash_token_ids(record.token_ids),
        "ranking": ranking,
        "block_tokens": block_tokens,
        "k_sums": k_sums,
        "v_sums": v_sums,
        "namespace": record.namespace,
    }
    if tombstones_seen:
        header["tombstones_seen"] = tombstones_seen
    body = msgpack.packb(header, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    head = prefix + body
    head += b"\0" * (-len(head) % ALIGN)
    return head, areas


@dataclass(frozen=True, eq=False)
class EncodedRecord:
    """A record serialised in memory, ready to write: ``size`` is the exact file size,
    known before any byte hits the disk (stores reserve capacity with it)."""

    head: bytes
    areas: tuple[np.ndarray, ...]

    @property
    def size(self) -> int:
        return len(self.head) + sum(a.size for a in self.areas)


def encode_record(
    record: ChunkKV, block_tokens: int = 32, tombstones_seen: int = 0
) -> EncodedRecord:
    head, areas = encode_header(record, block_tokens, tombstones_seen)
    return EncodedRecord(head, tuple(areas))


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


def _parse_header(
    prefix: bytes, body_reader: Any, file_size: int, model_digest: str | None = None
) -> RecordHeader:
    """The checked header. Once the header's own checksum holds, a record of another model
    (``model_digest`` given) or one naming a dtype this build does not know is foreign or
    newer, never corrupt: a disk tier shared by differently built or configured servers
    must not delete each other's files."""
    if len(prefix) < len(MAGIC) or prefix[: len(MAGIC)] != MAGIC:
        if MAGIC.startswith(prefix):
            raise TruncatedRecordError(f"file of {file_size} bytes ends inside the prefix")
        raise BadMagicError("not a chunk file (bad magic)")
    if len(prefix) < PREFIX_BYTES:
        raise TruncatedRecordError(f"file of {file_size} bytes ends inside the prefix")
    _, version, header_len, header_sha = _PREFIX.unpack(prefix)
    if version > FORMAT_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"format version {version}; this reader understands 1..{FORMAT_VERSION}"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CorruptRecordError(f"implausible header length {header_len}")
    if PREFIX_BYTES + header_len > file_size:
        raise TruncatedRecordError("file ends inside the header")
    body = body_reader(header_len)
    if hashlib.sha256(body).digest() != header_sha:
        raise CorruptRecordError("header checksum mismatch")
    try:
        h = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CorruptRecordError(f"unreadable header: {exc}") from exc
    if not isinstance(h, dict):
        raise CorruptRecordError("header is not a map")
    if model_digest is not None and h.get("model") != model_digest:
        raise ForeignModelError(f"record is for another model than {model_digest[:12]}")
    dtype = h.get("dtype")
    if not isinstance(dtype, str):
        raise CorruptRecordError(f"header dtype is a {type(dtype).__name__}, not a name")
    if dtype not in DTYPES:
        raise UnsupportedFormatError(f"dtype {dtype!r} unknown to this reader")
    try:
        # Exact types and ranges: a header with a valid checksum is still anyone's bytes
        # (a shared disk or store), and a float, a bool or an out-of-range integer here
        # must read as a corrupt record, never as an exception its callers do not expect.
        num_tokens, num_layers = _int(h, "num_tokens"), _int(h, "num_layers")
        token_ids = h["token_ids"]
        if not isinstance(token_ids, list) or not all(
            type(t) is int and 0 <= t < 1 << 32 for t in token_ids
        ):
            raise ValueError("token_ids is not a list of uint32")
        token_ids = tuple(token_ids)
        ranking = None
        if h["ranking"] is not None:
            ranking = torch.from_numpy(np.frombuffer(_bytes(h["ranking"]), dtype="<f4").copy())
        header = RecordHeader(
            version=_int(h, "version"),
            key=check_key(h["key"]),
            model_digest=check_key(h["model"]),
            dtype=dtype,
            layer_start=_int(h, "layer_start", low=0),
            num_layers=num_layers,
            num_tokens=num_tokens,
            num_kv_heads=_int(h, "num_kv_heads"),
            head_dim=_int(h, "head_dim"),
            token_ids=token_ids,
            token_ids_hash=_str(h["token_ids_hash"]),
            ranking=ranking,
            block_tokens=_int(h, "block_tokens"),
            k_sums=tuple(_bytes(s) for s in _list(h["k_sums"])),
            v_sums=tuple(_bytes(s) for s in _list(h["v_sums"])),
            data_offset=PREFIX_BYTES + header_len + (-(PREFIX_BYTES + header_len) % ALIGN),
            namespace=check_namespace(_str(h.get("namespace", ""))),
            tombstones_seen=_int(h, "tombstones_seen", low=0) if "tombstones_seen" in h else 0,
        )
    except (KeyError, TypeError, ValueError, OverflowError, msgpack.UnpackException) as exc:
        raise CorruptRecordError(f"unreadable header: {exc}") from exc
    expected_sums = header.num_blocks * DIGEST_BYTES
    if (
        header.version != version
        or min(num_tokens, num_layers, header.num_kv_heads, header.head_dim) < 1
        or header.block_tokens < 1
        or len(token_ids) != num_tokens
        or (ranking is not None and ranking.numel() != num_tokens)
        or len(header.k_sums) != num_layers
        or len(header.v_sums) != num_layers
        or any(len(s) != expected_sums for s in header.k_sums + header.v_sums)
        or hash_token_ids(token_ids) != header.token_ids_hash
    ):
        raise CorruptRecordError("header fields are inconsistent")
    if file_size < header.file_size:
        raise TruncatedRecordError(f"file has {file_size} bytes, header says {header.file_size}")
    if file_size > header.file_size:
        raise CorruptRecordError(f"file has {file_size} bytes, header says {header.file_size}")
    return header


# Header fields above this are no record's: a few billion tokens, layers or heads.
_MAX_FIELD = 1 << 31


def _int(h: dict, name: str, low: int = 1) -> int:
    """Field ``name`` of a header map as an int in [low, 2**31), else ValueError."""
    value = h[name]
    if type(value) is not int or not low <= value < _MAX_FIELD:
        raise ValueError(f"header field {name} is {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _bytes(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError(f"expected bytes, got {type(value).__name__}")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return value


def _check_expectations(
    header: RecordHeader,
    model_digest: str | None,
    key: str | None,
    token_ids: Sequence[int] | None,
) -> None:
    if model_digest is not None and header.model_digest != model_digest:
        raise ForeignModelError(
            f"record is for model {header.model_digest[:12]}, expected {model_digest[:12]}"
        )
    if key is not None and header.key != key:
        raise CorruptRecordError(f"file holds key {header.key[:12]}, expected {key[:12]}")
    if token_ids is not None and tuple(int(t) for t in token_ids) != header.token_ids:
        raise TokenMismatchError(f"record {header.key[:12]} holds other token ids")


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
        header = _parse_header(f.read(PREFIX_BYTES), f.read, st.st_size, model_digest)
    _check_expectations(header, model_digest, key, token_ids)
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
                _parse_header(prefix, lambda n: b"", size)
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            mm = self._mm
            pos = PREFIX_BYTES
            self.header = _parse_header(
                mm[:PREFIX_BYTES], lambda n: mm[pos : pos + n], size, model_digest
            )
            _check_expectations(self.header, model_digest, key, token_ids)
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


__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX_BYTES",
    "EncodedRecord",
    "NotRegularFileError",
    "RecordFile",
    "RecordHeader",
    "RecordShapeError",
    "StoreError",
    "encode_record",
    "file_name",
    "open_regular",
    "read_header",
    "read_record",
    "write_record",
]
