"""The oracle's view of a decoder: its weights as plain tensors and the few settings that
tell one family's block from another's.

The defaults describe the Llama family (Llama, Mistral, Qwen2, Qwen3): one RoPE table for
every layer, full causal attention, RMSNorm scaling by ``w``, SwiGLU. Gemma 3 sets the
rest: a RoPE table and a sliding window per layer, RMSNorm scaling by ``1 + w``, norms of
the attention and MLP outputs, scaled embeddings, its own attention scale and GeGLU.
Readers (``weights.py``, ``gemma3.py``) build these; ``forward.py`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sgl_pic.oracle.rope_scaling import RopeFrequencies

MlpActivation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors. Every field is a tensor or None, so that a copy of the
    model in another dtype casts them all (``sgl_pic.fidelity.oracle_in_dtype``)."""

    input_norm: torch.Tensor  # [hidden] norm of the attention input
    q_proj: torch.Tensor  # [num_heads * head_dim, hidden]
    k_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    v_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    q_bias: torch.Tensor | None  # [num_heads * head_dim]
    k_bias: torch.Tensor | None  # [num_kv_heads * head_dim]
    v_bias: torch.Tensor | None  # [num_kv_heads * head_dim]
    o_bias: torch.Tensor | None  # [hidden]
    q_norm: torch.Tensor | None  # [head_dim] per-head RMSNorm of q (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None  # [head_dim] ... and of k
    post_norm: torch.Tensor  # [hidden] norm of the MLP input (Gemma: pre_feedforward)
    gate_proj: torch.Tensor  # [intermediate, hidden]
    up_proj: torch.Tensor  # [intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]
    # Gemma normalises each sublayer's output before the residual add; None elsewhere.
    attn_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]


@dataclass(frozen=True)
class ModelWeights:
    """Everything the oracle's forward needs; tensors are shared with the HF model and
    must not be modified.

    ``inv_freq`` and ``rope_scale`` are the RoPE table every layer shares. A model whose
    layers differ (Gemma 3: local and global layers) lists one table per layer in
    ``layer_rope`` and leaves ``inv_freq`` None, so that a caller rotating every layer by
    one table fails instead of rotating some layers wrongly: such callers use
    ``rope(layer)``."""

    model_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    inv_freq: torch.Tensor | None  # [head_dim // 2] float32 after any scaling; see above
    rope_scale: float  # factor on cos and sin (YaRN's mscale; 1.0 otherwise)
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    layer_rope: tuple[RopeFrequencies, ...] | None = None  # one per layer, where they differ
    # Sliding window per layer: position i sees j only if i - j < window; None: all j <= i.
    windows: tuple[int | None, ...] | None = None
    embed_scale: float | None = None  # factor on embeddings, in the embedding dtype
    attn_scale: float | None = None  # factor on q.k (None: head_dim ** -0.5)
    unit_offset_norms: bool = False  # RMSNorm scales by 1 + w (Gemma), not w
    mlp_activation: MlpActivation = "silu"

    def __post_init__(self) -> None:
        n = len(self.layers)
        if self.layer_rope is None and self.inv_freq is None:
            raise ValueError("a RoPE table is needed: inv_freq or layer_rope")
        if self.layer_rope is not None and len(self.layer_rope) != n:
            raise ValueError(f"{len(self.layer_rope)} RoPE tables for {n} layers")
        if self.windows is not None and len(self.windows) != n:
            raise ValueError(f"{len(self.windows)} windows for {n} layers")
        if self.windows is not None and any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"sliding windows must be >= 1, got {self.windows}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rope(self, layer: int) -> RopeFrequencies:
        """The RoPE table of ``layer``: what its keys and queries are rotated with."""
        if self.layer_rope is not None:
            return self.layer_rope[layer]
        assert self.inv_freq is not None  # __post_init__
        return RopeFrequencies(self.inv_freq, self.rope_scale, self.head_dim)

    def window(self, layer: int) -> int | None:
        """``layer``'s sliding window (None: full causal attention)."""
        return None if self.windows is None else self.windows[layer]
