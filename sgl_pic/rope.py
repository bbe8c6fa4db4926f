"""Rotary position embedding in plain torch: apply, and re-rotate between positions.

RoPE rotates each pair of key dimensions by ``position * inv_freq``. Rotations compose
additively, so a key encoded at position p moves to q by one rotation of (q - p):
this is what makes a chunk's cached keys reusable at any offset.

Two layouts: ``neox`` (rotate-half; Llama, Qwen2, Mistral in HF form) pairs dimension
i with i + d/2; ``interleaved`` (GPT-J) pairs 2i with 2i + 1.
"""

from __future__ import annotations

from typing import Literal

import torch

RopeLayout = Literal["neox", "interleaved"]


def default_inv_freq(
    head_dim: int, theta: float, device: torch.device | None = None
) -> torch.Tensor:
    """# [head_dim // 2] float32 frequencies of standard RoPE."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return (1.0 / (theta**exponent)).to(torch.float32)


def rope_cos_sin(
    positions: torch.Tensor,  # [num_tokens] int or float
    inv_freq: torch.Tensor,  # [rotary_dim // 2]
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each # [num_tokens, rotary_dim // 2], computed in float64 then
    cast to float32 so that large positions keep their precision."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return (torch.cos(angles) * scale).to(torch.float32), (torch.sin(angles) * scale).to(
        torch.float32
    )


def apply_rope(
    x: torch.Tensor,  # [..., num_tokens, num_heads, head_dim], e.g. [num_layers, ...] too
    positions: torch.Tensor,  # [num_tokens]
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
    scale: float = 1.0,
) -> torch.Tensor:
    """A new tensor: x rotated to ``positions``. Partial rotary dims are rejected.

    Leading dims (layers) share the tokens' positions: one call rotates a chunk's keys in
    every layer, since per-call costs, not arithmetic, dominate a loop over layers."""
    head_dim = x.shape[-1]
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(
            f"partial rotary embedding is not supported: rotary dim {inv_freq.numel() * 2} "
            f"!= head dim {head_dim}"
        )
    if x.dim() < 3 or positions.shape[0] != x.shape[-3]:
        raise ValueError(f"{positions.shape[0]} positions for x of shape {tuple(x.shape)}")
    if layout not in ("neox", "interleaved"):
        raise ValueError(f"unknown RoPE layout {layout!r}; valid: neox, interleaved")
    cos, sin = rope_cos_sin(positions, inv_freq, scale)
    return rotate_with(x, cos, sin, layout)


def rotate_with(
    x: torch.Tensor,  # [..., num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2] from ``rope_cos_sin`` (or [1, ...])
    sin: torch.Tensor,  # [num_tokens, head_dim // 2]
    layout: RopeLayout = "neox",
    out: torch.Tensor | None = None,  # float32, x's shape, not overlapping x
) -> torch.Tensor:
    """A new tensor: ``x`` rotated by the angles of ``cos``/``sin`` (``apply_rope`` once
    they are computed: a caller rotating many tensors by the same positions computes them
    once); one row of angles rotates every token by the same amount. With ``out`` (a
    float32 ``x`` only) the result is written there, e.g. straight into a pool's rows,
    and ``out`` is returned. Arguments are not checked here; ``apply_rope`` checks them."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    head_dim = x.shape[-1]
    xf = x.to(torch.float32)
    into = out is not None
    if out is None:
        out = torch.empty(xf.shape, dtype=torch.float32, device=xf.device)
    if layout == "neox":
        half = head_dim // 2
        x1, x2, o1, o2 = xf[..., :half], xf[..., half:], out[..., :half], out[..., half:]
    else:
        x1, x2, o1, o2 = xf[..., 0::2], xf[..., 1::2], out[..., 0::2], out[..., 1::2]
    # Written into the halves of ``out``: no temporaries to concatenate.
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out if into else out.to(x.dtype)


def rerotate(
    k: torch.Tensor,  # [..., num_tokens, num_kv_heads, head_dim], post-RoPE at old_positions
    old_positions: torch.Tensor,  # [num_tokens]
    new_positions: torch.Tensor,  # [num_tokens]
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
) -> torch.Tensor:
    """A new tensor: post-RoPE keys moved from old to new positions in one rotation.
    Attention scaling of scaled RoPE variants is already in k and is not reapplied."""
    delta = new_positions.to(torch.int64) - old_positions.to(torch.int64)
    return apply_rope(k, delta, inv_freq, layout)


def rotate_layers(
    keys: torch.Tensor,  # [num_layers, num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] rotation per token (negative un-rotates)
    inv_freq: torch.Tensor,  # [head_dim // 2]
    layout: RopeLayout = "neox",
) -> torch.Tensor:
    """A new tensor: every layer's keys rotated by ``positions``, in one RoPE call."""
    return apply_rope(keys, positions, inv_freq, layout)
