"""RoPE frequencies and attention scaling of a model config, as HF and SGLang compute them.

The oracle reads them from the config rather than from a loaded model's rotary buffer so
that the formulas are stated here, in one place, and checked against both
implementations by the tests. Arithmetic is float32 in the same order as HF's
``modeling_rope_utils`` and SGLang's ``rotary_embedding`` (they agree), so plain RoPE
comes out bit for bit equal.

Supported: ``default``, ``linear``, ``llama3`` (Llama 3.1 frequency-dependent scaling)
and ``yarn`` (blended frequencies plus an attention scale on cos and sin). Dynamic NTK and
LongRoPE change the frequencies with the sequence length, so a key rotated once is not
valid at every length; they are rejected.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeFrequencies(NamedTuple):
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    attention_scaling: float  # factor on cos and sin (YaRN's mscale; 1.0 otherwise)
    rotary_dim: int  # head dims rotated (the rest, if any, pass through)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings as one dict with ``rope_type`` and ``rope_theta``:
    transformers 5 keeps them in ``rope_parameters``; older configs split them into
    ``rope_theta`` and an optional ``rope_scaling`` dict. Models with a table per kind of
    layer (Gemma 3) nest them by layer type: ``layer_type`` picks one."""
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None:
        if not params or not isinstance(params.get(layer_type), dict):
            raise ValueError(f"the config has no RoPE parameters for {layer_type!r} layers")
        params = params[layer_type]
    if params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def rope_frequencies(config: Any, layer_type: str | None = None) -> RopeFrequencies:
    """inv_freq and attention scaling of ``config`` (a HF ``PretrainedConfig`` or any
    object with its attributes), of its ``layer_type`` layers where the config nests them
    by type. Raises NotImplementedError for unsupported RoPE types."""
    p = rope_parameters(config, layer_type)
    kind = p["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"RoPE type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    partial = p.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dim = int(head_dim * partial)
    base = float(p["rope_theta"])
    if kind == "yarn":
        return _yarn(p, base, dim, int(config.max_position_embeddings))
    inv_freq = _default_inv_freq(base, dim)
    if kind == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(p, inv_freq)
    return RopeFrequencies(inv_freq, 1.0, dim)


def check_model_rope(
    theirs_inv_freq: torch.Tensor | None,  # [rotary_dim // 2] the model's own, if it keeps one
    theirs_scaling: float,
    ours: RopeFrequencies,
) -> None:
    """The frequencies computed from the config must be the ones the HF model rotates
    with: a RoPE variant or option the formulas here miss fails loudly, not silently.
    Raises ValueError; a model that keeps no frequency buffer is not checked."""
    if theirs_inv_freq is None:
        return
    theirs = theirs_inv_freq.detach().to(torch.float32)
    if theirs.shape != ours.inv_freq.shape or not torch.allclose(
        theirs, ours.inv_freq, rtol=1e-6, atol=0
    ):
        raise ValueError("RoPE frequencies from the config differ from the model's own")
    if abs(float(theirs_scaling) - ours.attention_scaling) > 1e-6:
        raise ValueError(
            f"RoPE attention scaling {ours.attention_scaling} differs from the model's "
            f"{float(theirs_scaling)}"
        )


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """# [dim // 2]: 1 / base^(2i / dim), in float32 as HF and SGLang compute it."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _llama3(p: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: wavelengths shorter than original_context / high_freq_factor are kept,
    longer than original_context / low_freq_factor divided by ``factor``, and those in
    between interpolated smoothly."""
    factor = float(p["factor"])
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_context = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(p: dict[str, Any], base: float, dim: int, max_position: int) -> RopeFrequencies:
    """YaRN (Peng et al.): per-dimension blend of original and ``factor``-interpolated
    frequencies over a linear ramp between the correction dims of beta_fast and
    beta_slow rotations in the original context, and cos/sin scaled by mscale."""
    original = int(p.get("original_max_position_embeddings") or max_position)
    factor = p.get("factor")
    # DeepSeek-style configs leave factor out and give the ratio of the two contexts.
    factor = float(factor) if factor is not None else max_position / original

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = p.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            scaling = get_mscale(factor)
        # SGLang's extra multiplier (HF folds it into attention_factor instead).
        scaling *= float(p.get("attn_factor", 1.0))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp) * float(p.get("extrapolation_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return RopeFrequencies(inv_freq, float(scaling), dim)
