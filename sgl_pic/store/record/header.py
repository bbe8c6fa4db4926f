"""The header of a chunk file (layout in ``sgl_pic.store.format``): its fixed 48-byte
prefix and checksummed msgpack map, packed for a writer and parsed, with every field
checked, for a reader. A header whose checksum holds is still anyone's bytes (a shared
disk or store), so parsing turns any malformed field into a ``StoreError`` subclass,
never another exception. Pure functions of bytes, safe on any thread.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from sgl_pic.store.base import DTYPES, check_key, check_namespace, hash_token_ids, record_content
from sgl_pic.store.errors import (
    BadMagicError,
    CorruptRecordError,
    ForeignModelError,
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
    context_contents: ``ChunkKV.context_contents``; () when absent (a chunk encoded
               alone). Optional too: an older reader serves no such chunk, whose key
               it never asks for.
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
    context_contents: tuple[str, ...] = ()

    @property
    def content(self) -> str:
        """``base.record_content`` of the record: what deletions match it by."""
        return record_content(self.token_ids_hash, self.context_contents)

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


def pack_header(fields: dict[str, Any]) -> bytes:
    """The prefix, the msgpack header of ``fields`` and its padding to ``ALIGN``: every
    byte of a file before its payload."""
    body = msgpack.packb(fields, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    head = prefix + body
    return head + b"\0" * (-len(head) % ALIGN)


def parse_header(
    prefix: bytes, body_reader: Any, file_size: int, model_digest: str | None = None
) -> RecordHeader:
    """The checked header. Once the header's own checksum holds, a record of another model
    (``model_digest`` given) or one naming a dtype this build does not know is foreign or
    newer, never corrupt: a disk tier shared by differently built or configured servers
    must not delete each other's files."""
    fixed = _parse_prefix(prefix, file_size)
    h = _unpack_body(body_reader(fixed.header_len), fixed.header_sha)
    dtype = _check_origin(h, model_digest)
    header = _build_header(h, dtype, fixed.header_len)
    _check_consistent(header, fixed.version)
    _check_file_size(header, file_size)
    return header


class _Prefix(NamedTuple):
    """The fields of a checked 48-byte prefix (the magic dropped)."""

    version: int
    header_len: int
    header_sha: bytes


def _parse_prefix(prefix: bytes, file_size: int) -> _Prefix:
    """The prefix's fields, checked before any body byte is read: magic, a version this
    reader understands and a header length that is plausible and within ``file_size``."""
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
    return _Prefix(version, header_len, header_sha)


def _unpack_body(body: bytes, header_sha: bytes) -> dict:
    """The msgpack map of ``body`` once its SHA-256 is ``header_sha``; else
    ``CorruptRecordError``."""
    if hashlib.sha256(body).digest() != header_sha:
        raise CorruptRecordError("header checksum mismatch")
    try:
        h = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CorruptRecordError(f"unreadable header: {exc}") from exc
    if not isinstance(h, dict):
        raise CorruptRecordError("header is not a map")
    return h


def _check_origin(h: dict, model_digest: str | None) -> str:
    """The header's dtype name, after the checks that make a record foreign or newer
    rather than corrupt: its model (when ``model_digest`` is given) and a known dtype."""
    if model_digest is not None and h.get("model") != model_digest:
        raise ForeignModelError(f"record is for another model than {model_digest[:12]}")
    dtype = h.get("dtype")
    if not isinstance(dtype, str):
        raise CorruptRecordError(f"header dtype is a {type(dtype).__name__}, not a name")
    if dtype not in DTYPES:
        raise UnsupportedFormatError(f"dtype {dtype!r} unknown to this reader")
    return dtype


def _build_header(h: dict, dtype: str, header_len: int) -> RecordHeader:
    """A ``RecordHeader`` of map ``h``, each field of its exact type and range; any
    malformed field raises ``CorruptRecordError``. Fields are read in a fixed order, so
    the first malformed one names the error. Cross-field checks are the caller's."""
    try:
        # Exact types and ranges: a header with a valid checksum is still anyone's bytes
        # (a shared disk or store), and a float, a bool or an out-of-range integer here
        # must read as a corrupt record, never as an exception its callers do not expect.
        num_tokens, num_layers = _int(h, "num_tokens"), _int(h, "num_layers")
        token_ids = _token_ids(h["token_ids"])
        ranking = None
        if h["ranking"] is not None:
            ranking = torch.from_numpy(np.frombuffer(_bytes(h["ranking"]), dtype="<f4").copy())
        return RecordHeader(
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
            context_contents=tuple(
                check_key(_str(c)) for c in _list(h.get("context_contents", []))
            ),
        )
    except (KeyError, TypeError, ValueError, OverflowError, msgpack.UnpackException) as exc:
        raise CorruptRecordError(f"unreadable header: {exc}") from exc


def _token_ids(value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of uint32 token ids, else ValueError."""
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in value):
        raise ValueError("token_ids is not a list of uint32")
    return tuple(value)


def _check_consistent(header: RecordHeader, version: int) -> None:
    """``CorruptRecordError`` unless the fields agree with each other and with the
    prefix's ``version``: sizes >= 1, one token id (and ranking value) per token, one
    digest per block of each layer, and the token ids hashing to ``token_ids_hash``."""
    num_tokens, num_layers = header.num_tokens, header.num_layers
    ranking = header.ranking
    expected_sums = header.num_blocks * DIGEST_BYTES
    if (
        header.version != version
        or min(num_tokens, num_layers, header.num_kv_heads, header.head_dim) < 1
        or header.block_tokens < 1
        or len(header.token_ids) != num_tokens
        or (ranking is not None and ranking.numel() != num_tokens)
        or len(header.k_sums) != num_layers
        or len(header.v_sums) != num_layers
        or any(len(s) != expected_sums for s in header.k_sums + header.v_sums)
        or hash_token_ids(header.token_ids) != header.token_ids_hash
    ):
        raise CorruptRecordError("header fields are inconsistent")


def _check_file_size(header: RecordHeader, file_size: int) -> None:
    """A file shorter than the header says is truncated, a longer one corrupt."""
    if file_size < header.file_size:
        raise TruncatedRecordError(f"file has {file_size} bytes, header says {header.file_size}")
    if file_size > header.file_size:
        raise CorruptRecordError(f"file has {file_size} bytes, header says {header.file_size}")


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


def check_expectations(
    header: RecordHeader,
    model_digest: str | None,
    key: str | None,
    token_ids: Sequence[int] | None,
) -> None:
    """Raises ForeignModelError, CorruptRecordError or TokenMismatchError when ``header``
    is not the record the caller expects (each check skipped when its value is None)."""
    if model_digest is not None and header.model_digest != model_digest:
        raise ForeignModelError(
            f"record is for model {header.model_digest[:12]}, expected {model_digest[:12]}"
        )
    if key is not None and header.key != key:
        raise CorruptRecordError(f"file holds key {header.key[:12]}, expected {key[:12]}")
    if token_ids is not None and tuple(int(t) for t in token_ids) != header.token_ids:
        raise TokenMismatchError(f"record {header.key[:12]} holds other token ids")
