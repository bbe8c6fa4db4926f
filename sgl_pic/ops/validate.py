"""Boundary checks of the KV ops, turning user arguments into validated plans.

Every public op (reference or CUDA) runs its arguments through a ``plan_*`` function
first: dtypes, devices, contiguity, shapes and index ranges are checked here, once, and
the backends then trust the plan. Index range checks read the indices' min and max,
which on CUDA is one device sync per call: the price of never writing out of bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from sgl_pic.rope import RopeLayout

KVBuffer = torch.Tensor | Sequence[torch.Tensor]
"""A KV buffer of every layer: one # [num_layers, num_rows, num_kv_heads, head_dim]
tensor (contiguous within each layer; layers may be further apart, as in ``kv[:, 0]`` of
a # [num_layers, 2, n, num_kv_heads, head_dim] tensor), or a sequence of num_layers
# [num_rows, num_kv_heads, head_dim] contiguous tensors (SGLang's ``k_buffer`` /
``v_buffer``)."""

KV_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
ROPE_LAYOUTS: tuple[RopeLayout, ...] = ("neox", "interleaved")


class Layers(NamedTuple):
    """Per-layer views of one KV buffer, all of one dtype, device and shape.

    views:    each # [num_rows, num_kv_heads, head_dim], contiguous.
    stacked:  the # [num_layers, num_rows, num_kv_heads, head_dim] tensor the views
              come from, or None when the layers are separate tensors.
    """

    views: tuple[torch.Tensor, ...]
    stacked: torch.Tensor | None

    @property
    def num_layers(self) -> int:
        return len(self.views)

    @property
    def row_shape(self) -> tuple[int, int]:
        """(num_kv_heads, head_dim)."""
        return self.views[0].shape[1], self.views[0].shape[2]

    @property
    def num_rows(self) -> int:
        return self.views[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.views[0].dtype

    @property
    def device(self) -> torch.device:
        return self.views[0].device


class CopyPlan(NamedTuple):
    """dst.views[l][dst_ids[i]] = src.views[l][src_ids[i] or i] for every layer l.

    src_ids, dst_ids: # [n] int64 on the device of dst; src_ids None means rows 0..n-1.
    """

    src: Layers
    src_ids: torch.Tensor | None
    dst: Layers
    dst_ids: torch.Tensor


class RopePlan(NamedTuple):
    """Rotate target rows (row_ids[i], or row i) of every layer by
    (positions[i] - old_positions[i]) * inv_freq, with cos and sin scaled by ``scale``.

    row_ids, positions, old_positions: # [n] int64 on the target's device.
    inv_freq: # [head_dim // 2] float32 on the target's device.
    old_positions is None for deferred RoPE of pre-RoPE keys.
    """

    target: Layers
    row_ids: torch.Tensor | None
    positions: torch.Tensor
    old_positions: torch.Tensor | None
    inv_freq: torch.Tensor
    layout: RopeLayout
    scale: float


def _check_kv_tensor(t: torch.Tensor, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in KV_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if not _layers_contiguous(t):
        raise ValueError(f"{name} must be contiguous within each layer (strides {t.stride()})")


def _layers_contiguous(t: torch.Tensor) -> bool:
    """Each layer contiguous, layers apart by a stride of at least one layer: K or V of a
    # [num_layers, 2, n, num_kv_heads, head_dim] tensor (``kv[:, 0]``) qualifies, so the
    ops take it without a copy; the kernels address layers by base + stride."""
    if t.dim() != 4 or t.shape[0] == 0:
        return t.is_contiguous()
    if not t[0].is_contiguous():
        return False
    # Overlapping layers (an expanded tensor) would let one layer's write land in another.
    return t.shape[0] == 1 or t.stride(0) >= t[0].numel()


def layers_of(buf: KVBuffer, name: str) -> Layers:
    """Layers of an all-layer buffer: a 4-D tensor or a sequence of 3-D tensors."""
    if isinstance(buf, torch.Tensor):
        _check_kv_tensor(buf, name, 4)
        if buf.shape[0] == 0:
            raise ValueError(f"{name} has no layers")
        return Layers(tuple(buf.unbind(0)), buf)
    if not isinstance(buf, Sequence) or len(buf) == 0:
        raise ValueError(f"{name} must be a 4-D tensor or a non-empty sequence of 3-D tensors")
    for i, t in enumerate(buf):
        _check_kv_tensor(t, f"{name}[{i}]", 3)
    first = buf[0]
    for i, t in enumerate(buf):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, but {name}[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    return Layers(tuple(buf), None)


def layer_of(t: torch.Tensor, name: str) -> Layers:
    """Layers of a one-layer buffer # [num_rows, num_kv_heads, head_dim]."""
    _check_kv_tensor(t, name, 3)
    return Layers((t,), t.unsqueeze(0))


def _index(ids: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """# [n] int64 on ``device``, contiguous."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {ids.dtype}; indices must be int32 or int64")
    return ids.to(device=device, dtype=torch.int64).contiguous()


def _check_ranges(checks: Sequence[tuple[torch.Tensor, int, str]]) -> None:
    """Each (ids, bound, name) must satisfy 0 <= ids < bound; one host read for all."""
    checks = [c for c in checks if c[0].numel() > 0]
    if not checks:
        return
    bounds = torch.stack([torch.stack(torch.aminmax(ids)) for ids, _, _ in checks]).tolist()
    for (lo, hi), (_, bound, name) in zip(bounds, checks, strict=True):
        if lo < 0 or hi >= bound:
            raise ValueError(f"{name} out of range: values in [{lo}, {hi}], valid [0, {bound})")


def _check_same_rows(a: Layers, a_name: str, b: Layers, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}")
    if a.row_shape != b.row_shape:
        raise ValueError(
            f"{a_name} rows are [num_kv_heads, head_dim] = {list(a.row_shape)} but "
            f"{b_name} rows are {list(b.row_shape)}"
        )
    if a.num_layers != b.num_layers:
        raise ValueError(f"{a_name} has {a.num_layers} layers but {b_name} has {b.num_layers}")


def _plan_copy(
    src: Layers, src_ids: torch.Tensor | None, dst: Layers, dst_ids: torch.Tensor, what: str
) -> CopyPlan:
    _check_same_rows(src, what, dst, "dst")
    if src.device != dst.device and src.device.type != "cpu":
        raise ValueError(f"{what} is on {src.device}; it must be on dst's {dst.device} or the CPU")
    slots = _index(dst_ids, "slot_ids", dst.device)
    checks = [(slots, dst.num_rows, "slot_ids")]
    tokens = None
    if src_ids is not None:
        tokens = _index(src_ids, "token_ids", dst.device)
        if tokens.shape != slots.shape:
            raise ValueError(f"{tokens.numel()} token_ids for {slots.numel()} slot_ids")
        checks.append((tokens, src.num_rows, "token_ids"))
    elif src.num_rows != slots.numel():
        raise ValueError(f"{src.num_rows} rows for {slots.numel()} slot_ids")
    _check_ranges(checks)
    return CopyPlan(src, tokens, dst, slots)


def plan_gather(
    src: torch.Tensor,  # [num_layers, num_src_tokens, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [n] int32/int64
    dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64
) -> CopyPlan:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    return _plan_copy(layers_of(src, "src"), token_ids, layers_of(dst, "dst"), slot_ids, "src")


def plan_gather_layer(
    src: torch.Tensor,  # [num_src_tokens, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [n] int32/int64
    dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64
) -> CopyPlan:
    return _plan_copy(layer_of(src, "src"), token_ids, layer_of(dst, "dst"), slot_ids, "src")


def plan_scatter(
    rows: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
    dst: KVBuffer,  # [num_layers, num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64
) -> CopyPlan:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    return _plan_copy(layers_of(rows, "rows"), None, layers_of(dst, "dst"), slot_ids, "rows")


def plan_scatter_layer(
    rows: torch.Tensor,  # [n, num_kv_heads, head_dim]
    dst: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    slot_ids: torch.Tensor,  # [n] int32/int64
) -> CopyPlan:
    return _plan_copy(layer_of(rows, "rows"), None, layer_of(dst, "dst"), slot_ids, "rows")


def _positions(p: torch.Tensor, name: str, n: int, device: torch.device) -> torch.Tensor:
    """# [n] int64 on ``device``."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.dim() != 1 or p.numel() != n:
        raise ValueError(f"{name} must have shape [{n}], one per rotated row; got {tuple(p.shape)}")
    if p.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {p.dtype}; positions must be int32 or int64")
    return p.to(device=device, dtype=torch.int64).contiguous()


def plan_rope(
    target: Layers,
    positions: torch.Tensor,  # [n] int32/int64
    old_positions: torch.Tensor | None,  # [n] int32/int64
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout,
    scale: float,
    slot_ids: torch.Tensor | None,  # [n] int32/int64
    position_names: tuple[str, str] = ("positions", "old_positions"),
) -> RopePlan:
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"unknown RoPE layout {layout!r}; valid: {', '.join(ROPE_LAYOUTS)}")
    _, head_dim = target.row_shape
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        raise ValueError("inv_freq must be a 1-D tensor # [head_dim // 2]")
    if not inv_freq.is_floating_point():
        raise ValueError(f"inv_freq has dtype {inv_freq.dtype}; it must be floating point")
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(
            f"partial rotary embedding is not supported: rotary dim {inv_freq.numel() * 2} "
            f"!= head dim {head_dim}"
        )
    if not isinstance(scale, float | int) or not torch.isfinite(torch.tensor(float(scale))):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    device = target.device
    rows = None
    n = target.num_rows
    if slot_ids is not None:
        rows = _index(slot_ids, "slot_ids", device)
        n = rows.numel()
        _check_ranges([(rows, target.num_rows, "slot_ids")])
    return RopePlan(
        target=target,
        row_ids=rows,
        positions=_positions(positions, position_names[0], n, device),
        old_positions=None
        if old_positions is None
        else _positions(old_positions, position_names[1], n, device),
        inv_freq=inv_freq.to(device=device, dtype=torch.float32).contiguous(),
        layout=layout,
        scale=float(scale),
    )


def checked_rows(
    ids: torch.Tensor,  # [n] int32/int64
    num_rows: int,
    device: torch.device,
    name: str = "slot_ids",
) -> torch.Tensor:
    """# [n] int64 on ``device``: ``ids`` checked to lie in [0, num_rows) (one host read)."""
    rows = _index(ids, name, device)
    _check_ranges([(rows, num_rows, name)])
    return rows
