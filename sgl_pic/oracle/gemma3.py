"""Gemma 3 (text) decoder weights as plain tensors, read from a HF ``Gemma3ForCausalLM``.

Gemma 3's block differs from the Llama family's in what ``ModelWeights`` records beside
the tensors, each as transformers' ``modeling_gemma3`` computes it:

- embeddings are multiplied by sqrt(hidden), that factor cast to the embedding dtype;
- every RMSNorm scales by ``1 + w`` (weights are stored zero-centred); each layer has four:
  of the attention input, of the attention output, of the MLP input, of the MLP output;
- q and k are normalised per head (that ``1 + w`` RMSNorm) before RoPE, so stored keys
  re-rotate like any other post-RoPE keys;
- attention scales q.k by ``query_pre_attn_scalar ** -0.5``; the MLP is GeGLU with the
  tanh approximation of GELU; the LM head is the (tied) embedding;
- each layer is ``sliding_attention`` or ``full_attention`` (``config.layer_types``).
  A sliding layer's token at position i sees j only if ``0 <= i - j < sliding_window``
  (transformers' mask; SGLang states the same window as ``sliding_window - 1`` in its own
  inclusive convention); and each kind of layer has its own RoPE table
  (``config.rope_parameters`` nested by layer type: local and global theta).

Logit soft-capping (Gemma 2) and bidirectional attention are rejected: Gemma 3's configs
leave them off.
"""

from __future__ import annotations

import math

import torch

from sgl_pic.oracle.model_weights import LayerWeights, ModelWeights
from sgl_pic.oracle.rope_scaling import RopeFrequencies, check_model_rope, rope_frequencies

GEMMA3_MODEL_TYPE = "gemma3_text"
SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_weights(model: torch.nn.Module) -> ModelWeights:
    """Read a loaded ``Gemma3ForCausalLM``; raises ValueError for a configuration the
    oracle's forward does not compute."""
    cfg = model.config
    if cfg.model_type != GEMMA3_MODEL_TYPE:
        raise ValueError(f"not a Gemma 3 text model: {cfg.model_type!r}")
    _check_supported(cfg)
    base = model.model
    head_dim = int(cfg.head_dim)
    tables = {kind: _layer_type_rope(cfg, base.rotary_emb, kind) for kind in set(cfg.layer_types)}
    for kind, rope in tables.items():
        if rope.rotary_dim != head_dim:
            raise ValueError(f"partial rotary embedding in {kind} layers is not supported")
    embed_scale = math.sqrt(cfg.hidden_size)
    theirs = getattr(base.embed_tokens, "scalar_embed_scale", embed_scale)
    if not math.isclose(float(theirs), embed_scale, rel_tol=1e-12):
        raise ValueError(f"embedding scale {theirs} is not sqrt(hidden) = {embed_scale}")
    return ModelWeights(
        model_type=cfg.model_type,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        rms_eps=float(cfg.rms_norm_eps),
        inv_freq=None,
        rope_scale=1.0,
        embed=base.embed_tokens.weight.detach(),
        layers=tuple(_layer(layer) for layer in base.layers),
        final_norm=base.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        layer_rope=tuple(tables[kind] for kind in cfg.layer_types),
        windows=tuple(int(cfg.sliding_window) if k == SLIDING else None for k in cfg.layer_types),
        embed_scale=embed_scale,
        attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        unit_offset_norms=True,
        mlp_activation="gelu_tanh",
    )


def _check_supported(cfg: object) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise ValueError(f"{name} is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention is not supported")
    act = getattr(cfg, "hidden_activation", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"MLP activation {act!r} is not supported (gelu_pytorch_tanh is)")
    kinds = set(cfg.layer_types)
    if not kinds <= {SLIDING, FULL}:
        raise ValueError(f"layer types {sorted(kinds - {SLIDING, FULL})} are not supported")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"{len(cfg.layer_types)} layer types for {cfg.num_hidden_layers} layers")


def _layer_type_rope(cfg: object, rotary: torch.nn.Module, kind: str) -> RopeFrequencies:
    """``kind`` layers' table from the config, checked against the model's own buffer."""
    rope = rope_frequencies(cfg, kind)
    check_model_rope(
        getattr(rotary, f"{kind}_inv_freq", None),
        getattr(rotary, f"{kind}_attention_scaling", 1.0),
        rope,
    )
    return rope


def _layer(layer: torch.nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if any(lin.bias is not None for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        raise ValueError("MLP biases are not supported")

    def bias(lin: torch.nn.Linear) -> torch.Tensor | None:
        return None if lin.bias is None else lin.bias.detach()

    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        q_proj=attn.q_proj.weight.detach(),
        k_proj=attn.k_proj.weight.detach(),
        v_proj=attn.v_proj.weight.detach(),
        o_proj=attn.o_proj.weight.detach(),
        q_bias=bias(attn.q_proj),
        k_bias=bias(attn.k_proj),
        v_bias=bias(attn.v_proj),
        o_bias=bias(attn.o_proj),
        q_norm=attn.q_norm.weight.detach(),
        k_norm=attn.k_norm.weight.detach(),
        post_norm=layer.pre_feedforward_layernorm.weight.detach(),
        gate_proj=mlp.gate_proj.weight.detach(),
        up_proj=mlp.up_proj.weight.detach(),
        down_proj=mlp.down_proj.weight.detach(),
        attn_out_norm=layer.post_attention_layernorm.weight.detach(),
        mlp_out_norm=layer.post_feedforward_layernorm.weight.detach(),
    )
