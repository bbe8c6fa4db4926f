"""The model the offline calibration stands in for: its dimensions (``ModelShape``,
SmolLM2-135M's by default) and a PROXY of one decoder layer's recompute cost
(``MatmulProxy``) for a CLI that has no engine to run the real layer forward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the proxy and the KV records use (SmolLM2-135M defaults)."""

    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    hidden: int = 576
    num_heads: int = 9
    intermediate: int = 1536
    rope_theta: float = 100000.0
    dtype: str = "float32"


class MatmulProxy:
    """A PROXY for one decoder layer's recompute cost: the q/k/v/o projections and the
    gated MLP of the model's shape as plain matmuls on random weights. It ignores
    attention over the context, norms and the real kernels; the engine should pass its
    real layer forward instead."""

    def __init__(
        self,
        shape: ModelShape,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        h, d = shape.hidden, shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
        self.device, self.dtype = torch.device(device), dtype

        def w(*s: int) -> torch.Tensor:
            return (torch.randn(*s, generator=g) / math.sqrt(s[0])).to(device, dtype)

        self.w_qkv = w(h, qkv)  # [hidden, (heads + 2 kv_heads) * head_dim]
        self.w_o = w(shape.num_heads * d, h)  # [heads * head_dim, hidden]
        self.w_gu = w(h, 2 * shape.intermediate)  # [hidden, 2 * intermediate]
        self.w_down = w(shape.intermediate, h)  # [intermediate, hidden]
        self.q_width = shape.num_heads * d
        self.hidden = h

    def __call__(self, num_tokens: int) -> torch.Tensor:
        """# [num_tokens, hidden] output for random inputs of ``num_tokens`` tokens."""
        x = torch.randn(num_tokens, self.hidden, device=self.device, dtype=self.dtype)
        q = (x @ self.w_qkv)[:, : self.q_width]
        x = x + q @ self.w_o
        gate, up = (x @ self.w_gu).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ self.w_down
