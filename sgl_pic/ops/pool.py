"""All-layer KV ops on an SGLang token pool: read slots out, write rows in, rotate keys.

The pool is anything exposing SGLang's per-layer accessors, ``get_key_buffer(layer)`` and
``get_value_buffer(layer)``, each # [num_slots, num_kv_heads, head_dim]. Writes and
rotations go through the public ops (``sgl_pic.ops.dispatch``: the CUDA kernels on a GPU,
the torch reference otherwise), on the current stream, in place. Reads use torch's own
index_select, which is a single device kernel per layer already: the copy kernel reads
stacked sources only, and the pool's layers are separate tensors.

Slots are checked to lie in the pool before anything runs (ValueError otherwise); that
check is one host read per call, so call these once per request, not once per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from sgl_pic.ops import dispatch
from sgl_pic.ops.kvops import OpResult
from sgl_pic.ops.validate import checked_rows
from sgl_pic.rope import RopeLayout


class KVPool(Protocol):
    """What these ops need of SGLang's MHATokenToKVPool."""

    def get_key_buffer(self, layer: int) -> torch.Tensor: ...

    def get_value_buffer(self, layer: int) -> torch.Tensor: ...


def pool_buffers(pool: KVPool, num_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The live K and V buffers of layers 0..num_layers-1, each
    # [num_slots, num_kv_heads, head_dim]."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    keys = [pool.get_key_buffer(i) for i in range(num_layers)]
    values = [pool.get_value_buffer(i) for i in range(num_layers)]
    return keys, values


def check_slots(
    slots: Sequence[tuple[torch.Tensor, str]],  # each (# [n] int32/int64, its name)
    num_slots: int,
) -> None:
    """Raises ValueError unless every slot lies in [0, num_slots): one host read for all
    the tensors (a device sync when they are on a GPU), so a caller that indexes the pool
    with torch's own ops afterwards checks once, not once per op."""
    slots = [(s, name) for s, name in slots if s.numel() > 0]
    if not slots:
        return
    bounds = torch.stack([torch.stack(torch.aminmax(s)) for s, _ in slots]).tolist()
    for (lo, hi), (_, name) in zip(bounds, slots, strict=True):
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"{name} out of range: values in [{lo}, {hi}], valid [0, {num_slots})")


def read_pool_kv(
    pool: KVPool,
    num_layers: int,
    slots: torch.Tensor,  # [n] int32/int64 pool slots
) -> torch.Tensor:
    """# [num_layers, 2, n, num_kv_heads, head_dim] a copy of K (index 0) and V (index 1)
    at ``slots``, on the pool's device and in its dtype. Ordered on the current stream:
    safe to use on that stream at once, on another after a sync."""
    keys, values = pool_buffers(pool, num_layers)
    first = keys[0]
    idx = checked_rows(slots, first.shape[0], first.device)
    out = torch.empty(
        (num_layers, 2, idx.numel(), *first.shape[1:]), dtype=first.dtype, device=first.device
    )
    for layer, (kb, vb) in enumerate(zip(keys, values, strict=True)):
        torch.index_select(kb, 0, idx, out=out[layer, 0])
        torch.index_select(vb, 0, idx, out=out[layer, 1])
    return out


def write_pool_kv(
    pool: KVPool,
    num_layers: int,
    slots: torch.Tensor,  # [n] int32/int64 distinct pool slots
    kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim] K then V
) -> OpResult:
    """Pool K and V at ``slots`` = ``kv[:, 0]`` and ``kv[:, 1]``, every layer. ``kv`` may
    be on the pool's device or in host memory (pinned: read by the kernel directly); a
    dtype other than the pool's is cast first (one copy). The pool is written when the
    current stream reaches the copy. One copy of 2 * num_layers buffers (K0, V0, K1, ...),
    so the slots are checked once (one host read), not once for K and once for V."""
    keys, values = pool_buffers(pool, num_layers)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(
            f"kv must be # [num_layers, 2, n, num_kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    if kv.shape[0] != num_layers:
        raise ValueError(f"kv has {kv.shape[0]} layers but {num_layers} are written")
    if kv.dtype != keys[0].dtype:
        kv = kv.to(keys[0].dtype)
    buffers = [b for pair in zip(keys, values, strict=True) for b in pair]
    # [2 * num_layers, n, ...] in the buffers' order: a view (K and V of a layer sit one
    # # [n, num_kv_heads, head_dim] block apart, whatever rows ``kv`` was sliced to).
    return dispatch.scatter_kv(kv.flatten(0, 1), buffers, slots)


def rotate_pool_keys(
    pool: KVPool,
    num_layers: int,
    slots: torch.Tensor,  # [n] int32/int64 distinct pool slots
    delta: torch.Tensor,  # [n] int32/int64 positions to move each slot's keys by
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
) -> OpResult:
    """The keys at ``slots`` rotated in place by ``delta[i]`` positions in every layer
    (post-RoPE keys at p move to p + delta; negative deltas un-rotate)."""
    keys, _ = pool_buffers(pool, num_layers)
    return dispatch.apply_rope_kv(keys, delta, inv_freq, layout, 1.0, slot_ids=slots)


def rotated_keys(
    keys: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim], e.g. kv[:, 0]
    delta: torch.Tensor,  # [n] int32/int64 positions to move each row by
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
) -> torch.Tensor:
    """# [num_layers, n, num_kv_heads, head_dim] a new tensor: ``keys`` rotated by
    ``delta[i]`` positions, row by row, every layer (``sgl_pic.rope.rotate_layers``
    through the ops)."""
    out = keys.clone(memory_format=torch.contiguous_format)
    dispatch.apply_rope_kv(out, delta, inv_freq, layout)
    return out
