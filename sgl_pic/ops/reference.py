"""Plain-torch references of the KV ops: same signatures and results as the public ops
in ``sgl_pic.ops`` (the dispatch module), usable on any device.

They define what the CUDA kernels must compute. The RoPE math is ``sgl_pic.rope``'s,
not a copy of it. Slot indices are assumed distinct: with repeats, which row lands in a
slot is unspecified, here as in the kernels.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

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
from sgl_pic.rope import RopeLayout, apply_rope, rerotate

Backend = Literal["cuda", "reference"]


class OpResult(NamedTuple):
    """What ran an op: the CUDA kernel or this module's torch code."""

    backend: Backend


REFERENCE = OpResult("reference")


def run_copy(plan: CopyPlan) -> None:
    """Executes a validated copy plan with torch indexing."""
    src_device = plan.src.device
    src_ids = None if plan.src_ids is None else plan.src_ids.to(src_device)
    for src, dst in zip(plan.src.views, plan.dst.views, strict=True):
        rows = src if src_ids is None else src.index_select(0, src_ids)
        dst.index_copy_(0, plan.dst_ids, rows.to(dst.device))


def run_rope(plan: RopePlan) -> None:
    """Executes a validated RoPE plan with ``sgl_pic.rope``."""
    for layer in plan.target.views:
        rows = layer if plan.row_ids is None else layer.index_select(0, plan.row_ids)
        if plan.old_positions is None:
            out = apply_rope(rows, plan.positions, plan.inv_freq, plan.layout, plan.scale)
        else:
            out = rerotate(rows, plan.old_positions, plan.positions, plan.inv_freq, plan.layout)
        if plan.row_ids is None:
            layer.copy_(out)
        else:
            layer.index_copy_(0, plan.row_ids, out)


def gather_kv(
    src: torch.Tensor,  # [num_layers, num_src_tokens, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [n] int32/int64, rows of src
    dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[l, slot_ids[i]] = src[l, token_ids[i]] for every layer l."""
    run_copy(plan_gather(src, token_ids, dst, slot_ids))
    return REFERENCE


def gather_kv_layer(
    src: torch.Tensor,  # [num_src_tokens, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [n] int32/int64, rows of src
    dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[slot_ids[i]] = src[token_ids[i]] in one layer."""
    run_copy(plan_gather_layer(src, token_ids, dst, slot_ids))
    return REFERENCE


def scatter_kv(
    rows: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
    dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[l, slot_ids[i]] = rows[l, i] for every layer l."""
    run_copy(plan_scatter(rows, dst, slot_ids))
    return REFERENCE


def scatter_kv_layer(
    rows: torch.Tensor,  # [n, num_kv_heads, head_dim]
    dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
) -> OpResult:
    """dst[slot_ids[i]] = rows[i] in one layer."""
    run_copy(plan_scatter_layer(rows, dst, slot_ids))
    return REFERENCE


def apply_rope_kv(
    k: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim], pre-RoPE
    positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    scale: float = 1.0,
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Deferred RoPE in place: k[l, slot_ids[i]] rotated to positions[i], every layer."""
    run_rope(plan_rope(layers_of(k, "k"), positions, None, inv_freq, layout, scale, slot_ids))
    return REFERENCE


def apply_rope_kv_layer(
    k: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], pre-RoPE
    positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    scale: float = 1.0,
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Deferred RoPE in place in one layer."""
    run_rope(plan_rope(layer_of(k, "k"), positions, None, inv_freq, layout, scale, slot_ids))
    return REFERENCE


_NEW_OLD = ("new_positions", "old_positions")


def rerotate_kv(
    k: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim], post-RoPE
    old_positions: torch.Tensor,  # [n] int32/int64
    new_positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Post-RoPE keys moved in place from old to new positions (one rotation by
    new - old), every layer."""
    plan = plan_rope(
        layers_of(k, "k"), new_positions, old_positions, inv_freq, layout, 1.0, slot_ids, _NEW_OLD
    )
    run_rope(plan)
    return REFERENCE


def rerotate_kv_layer(
    k: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], post-RoPE
    old_positions: torch.Tensor,  # [n] int32/int64
    new_positions: torch.Tensor,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
) -> OpResult:
    """Post-RoPE keys moved in place from old to new positions in one layer."""
    plan = plan_rope(
        layer_of(k, "k"), new_positions, old_positions, inv_freq, layout, 1.0, slot_ids, _NEW_OLD
    )
    run_rope(plan)
    return REFERENCE
