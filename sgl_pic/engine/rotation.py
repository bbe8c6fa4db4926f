"""Moving cached keys between positions with a model's own rotary table.

``RopeSpec`` is what the rotation needs of the model (read from SGLang's rotary modules by
``binding.model_rope``); ``ModelRope`` moves keys by any number of positions with it, and
``LayerRopes`` holds each decoder layer's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_pic.rope import RopeLayout


class RopeSpec(NamedTuple):
    """What the rotation reads from the model: the table, its layout, its scale, and
    the plain frequencies when the table is ``cos/sin(p * inv_freq)`` up to the fp32
    rounding of its angles (``fits_table``; the CUDA kernels and the host/disk tiers
    take frequencies, not tables)."""

    cos_sin: torch.Tensor  # [max_positions, rotary_dim] float32, row p = position p
    rotary_dim: int
    head_dim: int
    layout: RopeLayout
    mscale: float
    inv_freq: torch.Tensor | None  # [rotary_dim // 2] float32, or None


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


class LayerRopes(NamedTuple):
    """Each decoder layer's ``ModelRope`` (layers of one table share one object)."""

    by_layer: tuple[ModelRope, ...]

    def groups(self) -> list[tuple[ModelRope, list[int]]]:
        """The distinct tables with the layers each rotates, in first-layer order: a
        stacked KV is moved one table at a time."""
        seen: dict[int, tuple[ModelRope, list[int]]] = {}
        for layer, rope in enumerate(self.by_layer):
            seen.setdefault(id(rope), (rope, []))[1].append(layer)
        return list(seen.values())
