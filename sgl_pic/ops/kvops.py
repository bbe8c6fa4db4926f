"""The eight KV ops, written once: each checks its arguments into a plan
(``sgl_pic.ops.validate``) and hands the plan to a runner.

``sgl_pic.ops.reference`` binds them to the torch runners and ``sgl_pic.ops.dispatch``
to the runners that pick CUDA or torch per call, so the two modules cannot drift apart
in signature, validation or documentation. Every op works in place on its destination
and never writes out of bounds: indices out of range raise ValueError before anything
runs. Slot indices must be distinct; with repeats, which row lands in a slot is
unspecified, in every backend.
"""

from __future__ import annotations

from collections.abc import Callable
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
from sgl_pic.rope import RopeLayout

Backend = Literal["cuda", "reference"]


class OpResult(NamedTuple):
    """What ran an op: the CUDA kernel or the torch reference."""

    backend: Backend


# Rerotation takes (old, new) but plans (positions=new, old_positions=old); errors name
# the arguments as the caller wrote them.
_NEW_OLD = ("new_positions", "old_positions")


class KVOps:
    """The public ops over one pair of runners; a runner executes a validated plan and
    says which backend ran it."""

    def __init__(
        self,
        run_copy: Callable[[CopyPlan], OpResult],
        run_rope: Callable[[RopePlan], OpResult],
    ) -> None:
        self._run_copy = run_copy
        self._run_rope = run_rope

    def gather_kv(
        self,
        src: torch.Tensor,  # [num_layers, num_src_tokens, num_kv_heads, head_dim]
        token_ids: torch.Tensor,  # [n] int32/int64, rows of src
        dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
        slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
    ) -> OpResult:
        """dst[l, slot_ids[i]] = src[l, token_ids[i]] for every layer l.

        Loads a cached chunk's reused tokens into pool slots. ``src`` may be on dst's GPU
        or in pinned host memory (read by the kernel directly); ``dst`` may be SGLang's
        list of per-layer pool tensors.
        """
        return self._run_copy(plan_gather(src, token_ids, dst, slot_ids))

    def gather_kv_layer(
        self,
        src: torch.Tensor,  # [num_src_tokens, num_kv_heads, head_dim]
        token_ids: torch.Tensor,  # [n] int32/int64, rows of src
        dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
    ) -> OpResult:
        """dst[slot_ids[i]] = src[token_ids[i]] in one layer (layer-by-layer loading)."""
        return self._run_copy(plan_gather_layer(src, token_ids, dst, slot_ids))

    def scatter_kv(
        self,
        rows: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
        dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
        slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
    ) -> OpResult:
        """dst[l, slot_ids[i]] = rows[l, i] for every layer l: recomputed K or V into
        slots."""
        return self._run_copy(plan_scatter(rows, dst, slot_ids))

    def scatter_kv_layer(
        self,
        rows: torch.Tensor,  # [n, num_kv_heads, head_dim]
        dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        slot_ids: torch.Tensor,  # [n] int32/int64, distinct slots of dst
    ) -> OpResult:
        """dst[slot_ids[i]] = rows[i] in one layer."""
        return self._run_copy(plan_scatter_layer(rows, dst, slot_ids))

    def apply_rope_kv(
        self,
        k: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim], pre-RoPE
        positions: torch.Tensor,  # [n] int32/int64
        inv_freq: torch.Tensor,  # [head_dim // 2]
        layout: RopeLayout = "neox",
        scale: float = 1.0,
        slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
    ) -> OpResult:
        """Deferred RoPE in place: k[l, slot_ids[i]] rotated to positions[i], every layer,
        as ``sgl_pic.rope.apply_rope`` would. Partial rotary dims raise ValueError."""
        target = layers_of(k, "k")
        return self._run_rope(plan_rope(target, positions, None, inv_freq, layout, scale, slot_ids))

    def apply_rope_kv_layer(
        self,
        k: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], pre-RoPE
        positions: torch.Tensor,  # [n] int32/int64
        inv_freq: torch.Tensor,  # [head_dim // 2]
        layout: RopeLayout = "neox",
        scale: float = 1.0,
        slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
    ) -> OpResult:
        """Deferred RoPE in place in one layer."""
        target = layer_of(k, "k")
        return self._run_rope(plan_rope(target, positions, None, inv_freq, layout, scale, slot_ids))

    def rerotate_kv(
        self,
        k: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim], post-RoPE
        old_positions: torch.Tensor,  # [n] int32/int64
        new_positions: torch.Tensor,  # [n] int32/int64
        inv_freq: torch.Tensor,  # [head_dim // 2]
        layout: RopeLayout = "neox",
        slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
    ) -> OpResult:
        """Post-RoPE keys moved in place from old to new positions, one rotation by
        new - old, every layer (``sgl_pic.rope.rerotate``)."""
        target = layers_of(k, "k")
        return self._run_rope(
            plan_rope(
                target, new_positions, old_positions, inv_freq, layout, 1.0, slot_ids, _NEW_OLD
            )
        )

    def rerotate_kv_layer(
        self,
        k: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], post-RoPE
        old_positions: torch.Tensor,  # [n] int32/int64
        new_positions: torch.Tensor,  # [n] int32/int64
        inv_freq: torch.Tensor,  # [head_dim // 2]
        layout: RopeLayout = "neox",
        slot_ids: torch.Tensor | None = None,  # [n] int32/int64, distinct; None: all n = num_slots
    ) -> OpResult:
        """Post-RoPE keys moved in place from old to new positions in one layer."""
        target = layer_of(k, "k")
        return self._run_rope(
            plan_rope(
                target, new_positions, old_positions, inv_freq, layout, 1.0, slot_ids, _NEW_OLD
            )
        )
