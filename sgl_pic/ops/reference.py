"""Plain-torch references of the KV ops: same signatures and results as the public ops
in ``sgl_pic.ops`` (the dispatch module), usable on any device.

They define what the CUDA kernels must compute. The RoPE math is ``sgl_pic.rope``'s,
not a copy of it. Slot indices are assumed distinct: with repeats, which row lands in a
slot is unspecified, here as in the kernels.
"""

from __future__ import annotations

import torch

from sgl_pic.ops.kvops import KVOps, OpResult
from sgl_pic.ops.validate import CopyPlan, RopePlan
from sgl_pic.rope import apply_rope, rerotate

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
    if plan.row_ids is None and plan.target.stacked is not None:
        # Every row of a stacked buffer (a chunk's KV, not the pool): all layers in one
        # call, far cheaper than a pass per layer for a short chunk.
        plan.target.stacked.copy_(_rotated(plan.target.stacked, plan))
        return
    for layer in plan.target.views:
        rows = layer if plan.row_ids is None else layer.index_select(0, plan.row_ids)
        out = _rotated(rows, plan)
        if plan.row_ids is None:
            layer.copy_(out)
        else:
            layer.index_copy_(0, plan.row_ids, out)


def _rotated(
    rows: torch.Tensor,  # [..., n, num_kv_heads, head_dim], rotated by the plan's positions
    plan: RopePlan,
) -> torch.Tensor:
    if plan.old_positions is None:
        return apply_rope(rows, plan.positions, plan.inv_freq, plan.layout, plan.scale)
    return rerotate(rows, plan.old_positions, plan.positions, plan.inv_freq, plan.layout)


def _copy(plan: CopyPlan) -> OpResult:
    run_copy(plan)
    return REFERENCE


def _rope(plan: RopePlan) -> OpResult:
    run_rope(plan)
    return REFERENCE


# The public ops (``sgl_pic.ops.kvops``) bound to the torch runners above, whatever the
# tensors' device: the results the CUDA kernels are tested against.
_OPS = KVOps(_copy, _rope)
gather_kv = _OPS.gather_kv
gather_kv_layer = _OPS.gather_kv_layer
scatter_kv = _OPS.scatter_kv
scatter_kv_layer = _OPS.scatter_kv_layer
apply_rope_kv = _OPS.apply_rope_kv
apply_rope_kv_layer = _OPS.apply_rope_kv_layer
rerotate_kv = _OPS.rerotate_kv
rerotate_kv_layer = _OPS.rerotate_kv_layer
