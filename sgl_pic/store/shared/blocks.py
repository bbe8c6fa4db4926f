"""Sparse, verified reads of one record in the shared store: only the checksum blocks
holding the wanted tokens move, and each is checked before any byte is returned."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from sgl_pic.store.base import DTYPES
from sgl_pic.store.errors import CorruptRecordError
from sgl_pic.store.record.header import DIGEST_BYTES, RecordHeader
from sgl_pic.store.store_link import StoreLink


def read_blocks(
    link: StoreLink,
    key: str,
    header: RecordHeader,
    offsets: range,
    idx: np.ndarray,  # [n] int64 sorted unique token indices
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(k, v # [len(offsets), n, heads, head_dim], bytes moved) of the tokens ``idx`` of
    record layers ``offsets`` of ``key``, every touched block verified; None on a miss.
    Raises ``CorruptRecordError`` for a block that fails its checksum, and what
    ``link.call`` raises. Safe from any thread."""
    h = header
    bt, row = h.block_tokens, h.row_bytes
    blocks = np.unique(idx // bt).tolist()
    # Runs of adjacent blocks become one range each.
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    ranges: list[tuple[int, int]] = []
    for lo in offsets:
        for which in (0, 1):
            area = h.data_offset + (2 * lo + which) * h.layer_bytes
            for b0, b1 in runs:
                first, last = b0 * bt, min(b1 * bt, h.num_tokens)
                ranges.append((area + first * row, (last - first) * row))
    data = link.call(lambda b: b.read_ranges(key, ranges))
    if data is None:
        return None
    out = np.empty((2, len(offsets), idx.size, row), dtype=np.uint8)
    pos = 0
    for i, lo in enumerate(offsets):
        for which, sums in ((0, h.k_sums[lo]), (1, h.v_sums[lo])):
            # Rows of this (layer, K/V) area that were read, in token order.
            got = []
            for b0, b1 in runs:
                first, last = b0 * bt, min(b1 * bt, h.num_tokens)
                n = (last - first) * row
                part = data[pos : pos + n]
                pos += n
                for b in range(b0, b1):
                    s = (b - b0) * bt * row
                    e = min((b + 1 - b0) * bt, last - first) * row
                    want = sums[b * DIGEST_BYTES : (b + 1) * DIGEST_BYTES]
                    if hashlib.sha256(part[s:e]).digest() != want:
                        raise CorruptRecordError(
                            f"checksum mismatch in layer {lo + h.layer_start}, block {b}"
                        )
                got.append((first, part.reshape(-1, row)))
            # Scattered back to token positions, so ``idx`` indexes them directly.
            rows = np.empty((h.num_tokens, row), dtype=np.uint8)
            for first, block_rows in got:
                rows[first : first + block_rows.shape[0]] = block_rows
            np.take(rows, idx, axis=0, out=out[which, i])
    dtype = DTYPES[h.dtype]
    shape = (len(offsets), idx.size, h.num_kv_heads, h.head_dim)
    kv = torch.from_numpy(out).view(dtype)
    return kv[0].reshape(shape), kv[1].reshape(shape), int(data.size)
