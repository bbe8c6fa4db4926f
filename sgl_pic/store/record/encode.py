"""A chunk record serialised for writing: its payload (each layer's K then V, as raw
tensor bytes) with a SHA-256 per block of tokens, and the header that describes both
(``record.header``). The size of the file is known before any byte reaches a disk, so
stores reserve capacity with it. Pure: reads the record, copies its tensors to the CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sgl_pic.store.base import ChunkKV, hash_token_ids
from sgl_pic.store.record.header import FORMAT_VERSION, pack_header


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
    if record.context_contents:
        # Optional, as tombstones_seen: absent, the record was encoded alone.
        header["context_contents"] = list(record.context_contents)
    return pack_header(header), areas


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
    """``record`` serialised with one checksum per ``block_tokens`` tokens of each layer's
    K and V; ``tombstones_seen``: see ``RecordHeader``."""
    head, areas = encode_header(record, block_tokens, tombstones_seen)
    return EncodedRecord(head, tuple(areas))
