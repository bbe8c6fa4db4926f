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

The frequencies are kept only where every row of the table fits them within the fp32
rounding of ``p * f``, a bound that grows with the position: SGLang's own fp32 tables
drift from exact cos/sin by ~1e-2 at 131k positions and keep them, while another theta
or scaling drifts far past it and loses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sgl_pic.engine.rotation import LayerRopes, ModelRope, RopeSpec

# Rotary classes whose key at p is the pre-RoPE key rotated by p with one fixed table.
SUPPORTED_ROTARY = (
    "RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
)


class UnsupportedRope(ValueError):
    """The model's position encoding is not one re-rotation can move."""


def _rotaries_in(module: torch.nn.Module) -> list[Any]:
    return [m for m in module.modules() if hasattr(m, "cos_sin_cache") and hasattr(m, "rotary_dim")]


def _check_rotary(m: Any) -> None:
    """Raises ``UnsupportedRope`` unless moving a key by d is row d of ``m``'s table."""
    name = type(m).__name__
    if name not in SUPPORTED_ROTARY:
        raise UnsupportedRope(f"rotary embedding {name} is not supported by re-rotation")
    if getattr(m, "position_start", 0):
        raise UnsupportedRope("rotary tables that do not start at position 0")
    if len(getattr(m, "scaling_factors", None) or ()) > 1:
        # One table per factor, concatenated: a row index is not a position delta.
        raise UnsupportedRope("linear RoPE scaling with several factors")


def find_rotary(model: Any) -> Any:
    """The model's rotary module (every attention layer must share its settings)."""
    found = _rotaries_in(model)
    if not found:
        raise UnsupportedRope("the model has no rotary embedding with a cos/sin table")
    first = found[0]
    for m in found:
        _check_rotary(m)
        if (m.rotary_dim, m.is_neox_style, m.head_size) != (
            first.rotary_dim,
            first.is_neox_style,
            first.head_size,
        ) or not torch.equal(m.cos_sin_cache, first.cos_sin_cache):
            raise UnsupportedRope("attention layers use different rotary embeddings")
    return first


def layer_rotaries(layers: Sequence[torch.nn.Module]) -> tuple[Any, ...]:
    """Each decoder layer's own rotary module, in layer order: Gemma 3's sliding-window
    and global layers rotate by different tables (theta 10k and 1M). Every layer must hold
    exactly one module (``UnsupportedRope`` otherwise); layers of one table share it."""
    out = []
    for i, layer in enumerate(layers):
        distinct = {id(m): m for m in _rotaries_in(layer)}
        if len(distinct) != 1:
            raise UnsupportedRope(f"decoder layer {i} holds {len(distinct)} rotary embeddings")
        (rotary,) = distinct.values()
        _check_rotary(rotary)
        out.append(rotary)
    return tuple(out)


# fp32's machine epsilon: SGLang builds each angle p * f in fp32 (rounded by half an ulp,
# i.e. up to p * f * eps / 2) and takes its cos and sin in fp32 (an ulp or two more).
_EPS32 = float(torch.finfo(torch.float32).eps)
# |table - cos/sin(p * f)| <= _SLACK * eps * (1 + p * f) for a table built from f: the
# angle's rounding, cos/sin's own, and f's recovery from row 1 (about eps * f), with room.
_SLACK = 8.0
_ROWS_PER_STEP = 8192  # rows checked at a time: float64 temporaries stay at a few MB


def fits_table(
    table: torch.Tensor,  # [max_positions, 2 * n] float32, row p = cos then sin
    inv_freq: torch.Tensor,  # [n]
) -> bool:
    """Whether every row p of ``table`` is ``cos(p * inv_freq), sin(p * inv_freq)`` within
    the fp32 rounding of the angle, a bound that grows with p * inv_freq: a 131k-row fp32
    table is off by ~1e-2 at its last rows and still exact, while a frequency wrong by more
    than a few fp32 ulps (another theta or scaling) drifts past the bound."""
    half = inv_freq.numel()
    if table.dim() != 2 or table.shape[1] != 2 * half:
        return False
    freq = inv_freq.detach().to(device=table.device, dtype=torch.float64)
    offsets = torch.arange(min(_ROWS_PER_STEP, table.shape[0]), device=table.device)
    local = offsets.double()[:, None] * freq[None, :]
    cos_local, sin_local = local.cos(), local.sin()
    for start in range(0, table.shape[0], _ROWS_PER_STEP):
        rows = table[start : start + _ROWS_PER_STEP].double()
        n = rows.shape[0]
        # Angle addition from the step's first row: exact to float64 rounding, and one
        # transcendental per frequency per step instead of one per element.
        c0, s0 = (start * freq).cos(), (start * freq).sin()
        cos = cos_local[:n] * c0 - sin_local[:n] * s0
        sin = sin_local[:n] * c0 + cos_local[:n] * s0
        angle = (start + offsets[:n]).double()[:, None] * freq[None, :]
        bound = _SLACK * _EPS32 * (1.0 + angle.abs())
        off = torch.maximum((rows[:, :half] - cos).abs(), (rows[:, half:] - sin).abs())
        if not bool((off <= bound).all()):
            return False
    return True


def plain_frequencies(
    table: torch.Tensor,  # [max_positions, 2 * n] float32
    hint: torch.Tensor | None = None,  # [n] the module's own frequencies, if it has them
) -> torch.Tensor | None:
    """# [n] float32 frequencies f with ``fits_table(table, f)``, else None: ``hint`` when
    it fits (the exact fp32 values the model used), else f read from row 1's angles."""
    if table.dim() != 2 or table.shape[0] < 2 or table.shape[1] % 2:
        return None
    half = table.shape[1] // 2
    row = table[1].double()
    recovered = torch.atan2(row[half:], row[:half])
    for freq in (hint, recovered):
        if freq is not None and freq.shape == recovered.shape and fits_table(table, freq):
            return freq.detach().to(device=table.device, dtype=torch.float32)
    return None


def _module_frequencies(rotary: Any) -> torch.Tensor | None:
    """The frequencies SGLang's module computes (``_compute_inv_freq``), or None."""
    try:
        return rotary._compute_inv_freq(rotary.base).detach()
    except Exception:  # noqa: BLE001 - only a hint; the table is read either way
        return None


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
    mscale = float(table[0, 0])  # cos(0) * m
    if not mscale > 0:
        raise UnsupportedRope("rotary table row 0 is not a scaled identity")
    inv_freq = None
    # The kernels rotate whole heads with unit scale only.
    if int(rotary.rotary_dim) == int(rotary.head_size) and mscale == 1.0:
        inv_freq = plain_frequencies(table, _module_frequencies(rotary))
    return RopeSpec(
        table,
        int(rotary.rotary_dim),
        int(rotary.head_size),
        "neox" if rotary.is_neox_style else "interleaved",
        mscale,
        inv_freq,
    )


def layer_ropes(layers: Sequence[torch.nn.Module], device: torch.device | str) -> LayerRopes:
    """Every layer's rotation (``layer_rotaries``), one ``rope_spec`` per distinct module."""
    made: dict[int, ModelRope] = {}
    ropes = []
    for m in layer_rotaries(layers):
        if id(m) not in made:
            made[id(m)] = ModelRope(rope_spec(m, device))
        ropes.append(made[id(m)])
    return LayerRopes(tuple(ropes))
