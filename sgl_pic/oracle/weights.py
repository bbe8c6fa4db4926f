"""Decoder weights of a Llama-family model as plain tensors, read from a HF model.

Llama, Mistral and Qwen2 share one block: RMSNorm, grouped-query attention with RoPE
(Qwen2 adds q/k/v biases), RMSNorm, SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q_proj: torch.Tensor  # [num_heads * head_dim, hidden]
    k_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    v_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    q_bias: torch.Tensor | None  # [num_heads * head_dim]
    k_bias: torch.Tensor | None  # [num_kv_heads * head_dim]
    v_bias: torch.Tensor | None  # [num_kv_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_proj: torch.Tensor  # [intermediate, hidden]
    up_proj: torch.Tensor  # [intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]


@dataclass(frozen=True)
class ModelWeights:
    """Everything the oracle's forward needs; tensors are shared with the HF model and
    must not be modified."""

    model_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    inv_freq: torch.Tensor  # [head_dim // 2]
    rope_scale: float  # attention scaling of scaled RoPE variants (1.0 for plain RoPE)
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def weights_from_hf(model: torch.nn.Module) -> ModelWeights:
    """Read a loaded ``*ForCausalLM`` of a supported family."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {cfg.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    base = model.model
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotary = base.rotary_emb
    inv_freq = rotary.inv_freq.detach().to(torch.float32).clone()
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(
            f"partial rotary embedding (rotary dim {inv_freq.numel() * 2}, head dim "
            f"{head_dim}) is not supported"
        )
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp

        def bias(lin: torch.nn.Linear) -> torch.Tensor | None:
            return None if lin.bias is None else lin.bias.detach()

        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                q_proj=attn.q_proj.weight.detach(),
                k_proj=attn.k_proj.weight.detach(),
                v_proj=attn.v_proj.weight.detach(),
                o_proj=attn.o_proj.weight.detach(),
                q_bias=bias(attn.q_proj),
                k_bias=bias(attn.k_proj),
                v_bias=bias(attn.v_proj),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_proj=mlp.gate_proj.weight.detach(),
                up_proj=mlp.up_proj.weight.detach(),
                down_proj=mlp.down_proj.weight.detach(),
            )
        )
    return ModelWeights(
        model_type=cfg.model_type,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        rms_eps=float(cfg.rms_norm_eps),
        inv_freq=inv_freq,
        rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
        embed=base.embed_tokens.weight.detach(),
        layers=tuple(layers),
        final_norm=base.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
    )


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A local HF model directory loaded on the CPU in ``dtype``, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model
