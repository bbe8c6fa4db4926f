"""Decoder weights of a supported model as plain tensors, read from a HF model.

Llama, Mistral, Qwen2 and Qwen3 share one block: RMSNorm, grouped-query attention with
RoPE, RMSNorm, SwiGLU MLP. Qwen2 adds q/k/v biases (and ``attention_bias`` configs of the
others biases on q/k/v/o); Qwen3 normalises each head of q and k (RMSNorm over the head
dim) before RoPE. RoPE frequencies and scaling come from the config (``rope_scaling``).
Gemma 3 (text) has a block of its own, read by ``gemma3.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sgl_pic.oracle.gemma3 import GEMMA3_MODEL_TYPE, gemma3_weights
from sgl_pic.oracle.model_weights import LayerWeights, ModelWeights
from sgl_pic.oracle.rope_scaling import check_model_rope, rope_frequencies

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, GEMMA3_MODEL_TYPE)

__all__ = ["LayerWeights", "ModelWeights", "load_hf_model", "weights_from_hf"]


def weights_from_hf(model: torch.nn.Module) -> ModelWeights:
    """Read a loaded ``*ForCausalLM`` of a supported family."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {cfg.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.model_type == GEMMA3_MODEL_TYPE:
        return gemma3_weights(model)
    base = model.model
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = rope_frequencies(cfg)
    if rope.rotary_dim != head_dim:
        raise ValueError(
            f"partial rotary embedding (rotary dim {rope.rotary_dim}, head dim {head_dim}) "
            "is not supported"
        )
    rotary = base.rotary_emb
    check_model_rope(
        getattr(rotary, "inv_freq", None), getattr(rotary, "attention_scaling", 1.0), rope
    )
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if any(getattr(lin, "bias", None) is not None for lin in _mlp_linears(mlp)):
            raise ValueError("MLP biases (mlp_bias) are not supported")
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                q_proj=attn.q_proj.weight.detach(),
                k_proj=attn.k_proj.weight.detach(),
                v_proj=attn.v_proj.weight.detach(),
                o_proj=attn.o_proj.weight.detach(),
                q_bias=_bias(attn.q_proj),
                k_bias=_bias(attn.k_proj),
                v_bias=_bias(attn.v_proj),
                o_bias=_bias(attn.o_proj),
                q_norm=None if q_norm is None else q_norm.weight.detach(),
                k_norm=None if k_norm is None else k_norm.weight.detach(),
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
        inv_freq=rope.inv_freq,
        rope_scale=rope.attention_scaling,
        embed=base.embed_tokens.weight.detach(),
        layers=tuple(layers),
        final_norm=base.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
    )


def _bias(lin: torch.nn.Linear) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias.detach()


def _mlp_linears(mlp: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return (mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A local HF model directory loaded on the CPU in ``dtype``, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model
