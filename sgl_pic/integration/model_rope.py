"""Re-rotation of cached keys with the serving model's own rotary embedding.

SGLang's rotary modules keep ``cos_sin_cache`` # [max_positions, rotary_dim]: row p holds
``m*cos(p*f)`` then ``m*sin(p*f)`` for the model's frequencies f and attention scale m
(1 except YaRN). Whatever scaling produced f (Llama-3, linear, YaRN) is inside the table, so
moving a key by d positions with row |d| divided by m (sin negated when d < 0) is right by
construction: rotations by fixed frequencies compose, and the m the key already carries is
kept. Partial rotary (``rotary_dim < head_dim``) and the neox/interleaved pairing are read
from the module too.

Position-dependent schemes whose rotation at p is not "rotate by p" (dynamic NTK, which
rebuilds its table with the length; LongRoPE's short/long switch; multimodal M-RoPE) are
not in ``SUPPORTED_ROTARY``: such models are refused at start-up.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from sgl_pic.rope import RopeLayout

# Rotary classes whose key at p is the pre-RoPE key rotated by p with one fixed table.
SUPPORTED_ROTARY = (
    "RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
)


class UnsupportedRope(ValueError):
    """The model's position encoding is not one re-rotation can move."""


class RopeSpec(NamedTuple):
    """What the rotation reads from the model: the table, its layout, its scale, and
    the plain frequencies when the table is exactly ``cos/sin(p * inv_freq)`` (the
    CUDA kernels take frequencies, not tables)."""

    cos_sin: torch.Tensor  # [max_positions, rotary_dim] float32, row p = position p
    rotary_dim: int
    head_dim: int
    layout: RopeLayout
    mscale: float
    inv_freq: torch.Tensor | None  # [rotary_dim // 2] float32, or None


def find_rotary(model: Any) -> Any:
    """The model's rotary module (every attention layer must share its settings)."""
    found = [m for m in model.modules() if hasattr(m, "cos_sin_cache") and hasattr(m, "rotary_dim")]
    if not found:
        raise UnsupportedRope("the model has no rotary embedding with a cos/sin table")
    first = found[0]
    for m in found:
        name = type(m).__name__
        if name not in SUPPORTED_ROTARY:
            raise UnsupportedRope(f"rotary embedding {name} is not supported by re-rotation")
        if (m.rotary_dim, m.is_neox_style, m.head_size) != (
            first.rotary_dim,
            first.is_neox_style,
            first.head_size,
        ) or not torch.equal(m.cos_sin_cache, first.cos_sin_cache):
            raise UnsupportedRope("attention layers use different rotary embeddings")
    if getattr(first, "position_start", 0):
        raise UnsupportedRope("rotary tables that do not start at position 0")
    if len(getattr(first, "scaling_factors", None) or ()) > 1:
        # One table per factor, concatenated: a row index is not a position delta.
        raise UnsupportedRope("linear RoPE scaling with several factors")
    return first


def rope_spec(rotary: Any, device: torch.device | str) -> RopeSpec:
    """The spec of an SGLang rotary module, its table copied to ``device`` in float32."""
    # The live buffer may have been cast to the activation dtype (bf16 on many servers);
    # the module rebuilds its fp32 table, scaling included, for the rotation here.
    try:
        table = rotary._compute_cos_sin_cache()
    except Exception:  # noqa: BLE001 - a module without the builder keeps its buffer
        table = rotary.cos_sin_cache
    if table.shape != rotary.cos_sin_cache.shape:
        table = rotary.cos_sin_cache
    table = table.detach().to(device=device, dtype=torch.float32).clone()
    half = int(rotary.rotary_dim) // 2
    mscale = float(table[0, 0])  # cos(0) * m
    if not mscale > 0:
        raise UnsupportedRope("rotary table row 0 is not a scaled identity")
    inv_freq = torch.atan2(table[1, half:], table[1, :half]) if table.shape[0] > 1 else None
    if inv_freq is not None and (int(rotary.rotary_dim) != int(rotary.head_size) or mscale != 1.0):
        inv_freq = None  # the kernels rotate whole heads with unit scale only
    if inv_freq is not None:
        pos = torch.arange(table.shape[0], device=device, dtype=torch.float64)
        ang = pos[:, None] * inv_freq.double()[None, :]
        rebuilt = torch.cat([ang.cos(), ang.sin()], dim=1).float()
        # SGLang builds its table in fp32, which rounds angles by ~position * 6e-8; a
        # wrong frequency is off by O(1) within a few hundred positions.
        if not torch.allclose(rebuilt, table, atol=1e-3, rtol=0):
            inv_freq = None
    return RopeSpec(
        table,
        int(rotary.rotary_dim),
        int(rotary.head_size),
        "neox" if rotary.is_neox_style else "interleaved",
        mscale,
        inv_freq,
    )


class ModelRope:
    """Moves keys between positions with the model's own table (see module doc)."""

    def __init__(self, spec: RopeSpec) -> None:
        self.spec = spec

    @classmethod
    def plain(
        cls,
        inv_freq: torch.Tensor,  # [head_dim // 2]
        max_positions: int = 32768,
        layout: RopeLayout = "neox",
    ) -> ModelRope:
        """Standard RoPE over whole heads (the table SGLang's ``RotaryEmbedding`` builds),
        for stand-in pools in tests and tools."""
        pos = torch.arange(max_positions, dtype=torch.float64, device=inv_freq.device)
        ang = pos[:, None] * inv_freq.double()[None, :]
        table = torch.cat([ang.cos(), ang.sin()], dim=1).float()
        dim = 2 * inv_freq.numel()
        return cls(RopeSpec(table, dim, dim, layout, 1.0, inv_freq.float()))

    @property
    def max_delta(self) -> int:
        return self.spec.cos_sin.shape[0] - 1

    def rotate(
        self,
        keys: torch.Tensor,  # [..., n, num_kv_heads, head_dim]
        delta: torch.Tensor,  # [n] int64, positions to move each token by (< 0 moves back)
    ) -> torch.Tensor:
        """A new tensor: ``keys`` moved by ``delta``; dims past rotary_dim unchanged."""
        spec = self.spec
        n = keys.shape[-3]
        if delta.shape != (n,):
            raise ValueError(f"{tuple(delta.shape)} deltas for {n} tokens")
        delta = delta.to(device=spec.cos_sin.device, dtype=torch.int64)
        mag = delta.abs()
        if n and int(mag.max()) > self.max_delta:
            raise ValueError(f"rotation by {int(mag.max())} exceeds the model's rotary table")
        half = spec.rotary_dim // 2
        rows = spec.cos_sin[mag] / spec.mscale  # [n, rotary_dim]
        cos = rows[:, :half]
        sin = rows[:, half:] * torch.where(delta < 0, -1.0, 1.0)[:, None]
        cos = cos[:, None, :].to(keys.device)  # broadcast over heads
        sin = sin[:, None, :].to(keys.device)
        xf = keys.to(torch.float32)
        rot, rest = xf[..., : spec.rotary_dim], xf[..., spec.rotary_dim :]
        if spec.layout == "neox":
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        if rest.shape[-1]:
            out = torch.cat([out, rest], dim=-1)
        return out.to(keys.dtype)
