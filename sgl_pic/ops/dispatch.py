"""The public KV ops: checked at the boundary, then run by the CUDA kernels when the
tensors are on a GPU and the kernels load, else by the torch reference.

Each op returns ``OpResult``, naming the backend that ran it. All ops work in place on
the destination, on the current CUDA stream, and never write out of bounds: indices
out of range raise ValueError before anything runs. Slot indices must be distinct.
"""

from __future__ import annotations

import warnings

import torch

from sgl_pic.ops import cuda, reference
from sgl_pic.ops.reference import Backend, OpResult
from sgl_pic.ops.validate import (
    CopyPlan,
    KVBuffer,
    RopePlan,
    layer_of,
    layers_of,
    plan_gather,
    plan_gather_layer,
    plan_rope,
    plan_scatter,
    plan_scatter_layer,
)
from sgl_pic.rope import RopeLayout

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    # Falling back is correct but slow; say so once per cause, not once per layer.
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cuda_ready(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    state = cuda.status()
    if not state.available:
        _warn_once(f"sgl_pic.ops: CUDA kernels unavailable, using torch: {state.reason}")
    return state.available


def copy_backend(plan: CopyPlan) -> Backend:
    """The backend a validated copy plan runs on."""
    if not _cuda_ready(plan.dst.device):
        return "reference"
    if not cuda.can_copy(plan):
        _warn_once("sgl_pic.ops: source on unpinned host memory; gathering through torch")
        return "reference"
    return "cuda"


def rope_backend(plan: RopePlan) -> Backend:
    """The backend a validated RoPE plan runs on."""
    if _cuda_ready(plan.target.device) and cuda.can_rope(plan):
        return "cuda"
    return "reference"


def _copy(plan: CopyPlan) -> OpResult:
    backend = copy_backend(plan)
    (cuda.run_copy if backend == "cuda" else reference.run_copy)(plan)
    return OpResult(backend)


def _rope(plan: RopePlan) -> OpResult:
    backend = rope_backend(plan)
    (cuda.run_rope if backend == "cuda" else reference.run_rope)(plan)
    return OpResult(backend)


def gather_kv(
    src: torch.Tensor,  # [num_layers, num_src_tokens, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [n] int32/int64, rows of src
    dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[l, slot_ids[i]] = src[l, token_ids[i]] for every layer l.

    Loads a cached chunk's reused tokens into pool slots. ``src`` may be on dst's GPU
    or in pinned host memory (read by the kernel directly); ``dst`` may be SGLang's list
    of per-layer pool tensors.
    """
    return _copy(plan_gather(src, token_ids, dst, slot_ids))


def gather_kv_layer(
    src: torch.Tensor,  # [num_src_tokens, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [n] int32/int64, rows of src
    dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[slot_ids[i]] = src[token_ids[i]] in one layer (layer-by-layer loading)."""
    return _copy(plan_gather_layer(src, token_ids, dst, slot_ids))


def scatter_kv(
    rows: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
    dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[l, slot_ids[i]] = rows[l, i] for every layer l: recomputed K or V into slots."""
    return _copy(plan_scatter(rows, dst, slot_ids))


def scatter_kv_layer(
    rows: torch.Tensor,  # [n, num_kv_heads, head_dim]
    dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[slot_ids[i]] = rows[i] in one layer."""
    return _copy(plan_scatter_layer(rows, dst, slot_ids))


def apply_rope_kv(
    k: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim], pre-RoPE
    positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    scale: float = 1.0,
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Deferred RoPE in place: k[l, slot_ids[i]] rotated to positions[i], every layer,
    as ``sgl_pic.rope.apply_rope`` would. Partial rotary dims raise ValueError."""
    return _rope(plan_rope(layers_of(k, "k"), positions, None, inv_freq, layout, scale, slot_ids))


def apply_rope_kv_layer(
    k: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], pre-RoPE
    positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    scale: float = 1.0,
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Deferred RoPE in place in one layer."""
    return _rope(plan_rope(layer_of(k, "k"), positions, None, inv_freq, layout, scale, slot_ids))


_NEW_OLD = ("new_positions", "old_positions")


def rerotate_kv(
    k: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim], post-RoPE
    old_positions: torch.Tensor,  # [n] int32/int64
    new_positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Post-RoPE keys moved in place from old to new positions, one rotation by
    new - old, every layer (``sgl_pic.rope.rerotate``)."""
    return _rope(
        plan_rope(
            layers_of(k, "k"),
            new_positions,
            old_positions,
            inv_freq,
            layout,
            1.0,
            slot_ids,
            _NEW_OLD,
        )
    )


def rerotate_kv_layer(
    k: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], post-RoPE
    old_positions: torch.Tensor,  # [n] int32/int64
    new_positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Post-RoPE keys moved in place from old to new positions in one layer."""
    return _rope(
        plan_rope(
            layer_of(k, "k"),
            new_positions,
            old_positions,
            inv_freq,
            layout,
            1.0,
            slot_ids,
            _NEW_OLD,
        )
    )
