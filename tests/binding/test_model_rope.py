"""Re-rotation with the model's own rotary table equals SGLang's rotary embedding applied
at the new position, for plain RoPE, Llama-3 and YaRN scaling, partial rotary and the
interleaved layout; unsupported schemes are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sgl_pic.binding.model_rope import (
    UnsupportedRope,
    find_rotary,
    fits_table,
    layer_ropes,
    plain_frequencies,
    rope_spec,
)
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.rope import apply_rope, default_inv_freq

pytestmark = pytest.mark.sglang

HEAD, HEADS, N = 64, 3, 7

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.fixture(autouse=True)
def cpu_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLang picks its rotary kernel by platform at construction; the server sets its CPU
    # engine flag before importing SGLang, a test process may not have.
    from sglang.srt.layers.rotary_embedding import base

    monkeypatch.setattr(base, "_is_cpu", True)


def sglang_rope(rotary_dim: int = HEAD, neox: bool = True, scaling: Any = None) -> Any:
    from sglang.srt.layers.rotary_embedding import get_rope

    return get_rope(HEAD, rotary_dim, 8192, 10000, neox, scaling, torch.float32)


def apply(rope: Any, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """keys # [N, HEADS, HEAD] rotated to ``pos`` by SGLang's own module."""
    q = torch.zeros(keys.shape[0], HEADS * HEAD)
    _, k = rope.forward_native(pos, q, keys.reshape(keys.shape[0], -1).clone())
    return k.reshape(keys.shape)


@pytest.mark.parametrize(
    ("rotary_dim", "neox", "scaling"),
    [
        pytest.param(HEAD, True, None, id="plain"),
        pytest.param(HEAD, False, None, id="interleaved"),
        pytest.param(HEAD // 2, True, None, id="partial"),
        pytest.param(HEAD, True, LLAMA3, id="llama3"),
        pytest.param(HEAD, True, YARN, id="yarn"),
    ],
)
def test_moving_a_key_equals_rotating_it_there(rotary_dim: int, neox: bool, scaling: Any) -> None:
    rope = sglang_rope(rotary_dim, neox, scaling)
    model = torch.nn.Sequential(rope)
    spec = rope_spec(find_rotary(model), "cpu")
    assert (spec.rotary_dim, spec.layout) == (rotary_dim, "neox" if neox else "interleaved")
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(N, HEADS, HEAD, generator=g)
    old = torch.tensor([0, 1, 5, 17, 300, 2000, 4095])
    new = torch.tensor([9, 0, 3000, 18, 7, 4000, 4095])
    at_old, at_new = apply(rope, pre, old), apply(rope, pre, new)
    moved = ModelRope(spec).rotate(at_old, new - old)
    # fp32 tables: the model itself rounds angles at ~position * 6e-8.
    torch.testing.assert_close(moved, at_new, atol=1e-3, rtol=1e-3)
    # Every layer at once, too (the pool's [L, n, H, D] reads).
    both = ModelRope(spec).rotate(torch.stack([at_old, 2 * at_old]), new - old)
    torch.testing.assert_close(both[1], 2 * at_new, atol=2e-3, rtol=1e-3)
    # Frequencies for the CUDA kernels only where the table is exactly plain RoPE.
    plain = rotary_dim == HEAD and spec.mscale == 1.0
    assert (spec.inv_freq is not None) == plain
    if scaling is None and plain:
        torch.testing.assert_close(spec.inv_freq, default_inv_freq(HEAD, 10000.0))


def test_yarn_keeps_its_attention_scale() -> None:
    spec = rope_spec(find_rotary(torch.nn.Sequential(sglang_rope(scaling=YARN))), "cpu")
    assert spec.mscale > 1.0  # so a key moved twice must not gain it twice
    rope = ModelRope(spec)
    k = torch.randn(N, HEADS, HEAD)
    back = rope.rotate(rope.rotate(k, torch.full((N,), 40)), torch.full((N,), -40))
    torch.testing.assert_close(back, k, atol=1e-4, rtol=1e-4)


def test_plain_table_matches_sglang() -> None:
    rope = sglang_rope()
    spec = rope_spec(find_rotary(torch.nn.Sequential(rope)), "cpu")
    plain = ModelRope.plain(default_inv_freq(HEAD, 10000.0), 8192)
    torch.testing.assert_close(plain.spec.cos_sin, spec.cos_sin, atol=5e-4, rtol=0)


def test_unsupported_and_inconsistent_rotaries_are_refused() -> None:
    with pytest.raises(UnsupportedRope, match="no rotary"):
        find_rotary(torch.nn.Linear(2, 2))
    dyn = sglang_rope(scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedRope, match="DynamicNTK"):
        find_rotary(torch.nn.Sequential(dyn))
    mixed = torch.nn.Sequential(sglang_rope(), sglang_rope(HEAD // 2))
    with pytest.raises(UnsupportedRope, match="different"):
        find_rotary(mixed)
    rope = ModelRope.plain(default_inv_freq(HEAD, 10000.0), 64)
    with pytest.raises(ValueError, match="exceeds"):
        rope.rotate(torch.zeros(1, 1, HEAD), torch.tensor([64]))


def test_rope_spec_lives_on_the_requested_device() -> None:
    spec = rope_spec(find_rotary(torch.nn.Sequential(sglang_rope())), torch.device("cpu"))
    assert spec.cos_sin.device.type == "cpu" and spec.cos_sin.dtype == torch.float32


def test_a_bf16_buffer_is_rebuilt_in_fp32() -> None:
    # SGLang casts the live table to the activation dtype on some paths; the rotation
    # must not inherit bf16 rows (nor lose the kernels' frequencies to the rounding).
    rope = sglang_rope()
    exact = rope_spec(find_rotary(torch.nn.Sequential(rope)), "cpu")
    rope.cos_sin_cache = rope.cos_sin_cache.to(torch.bfloat16)
    spec = rope_spec(find_rotary(torch.nn.Sequential(rope)), "cpu")
    assert torch.equal(spec.cos_sin, exact.cos_sin) and spec.inv_freq is not None


# Llama-3.1's scaling (131,072 positions from an 8,192-position original).
LLAMA31 = {**LLAMA3, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    ("positions", "theta", "scaling"),
    [
        pytest.param(8192, 1e4, None, id="8k-theta1e4"),
        pytest.param(32768, 1e6, None, id="32k-theta1e6"),
        pytest.param(131072, 5e5, None, id="131k-theta5e5"),
        pytest.param(131072, 5e5, LLAMA31, id="131k-llama3"),
    ],
)
def test_long_context_tables_keep_their_frequencies(
    positions: int, theta: float, scaling: Any
) -> None:
    # SGLang's fp32 table drifts from exact cos/sin by ~p * f * 6e-8 (1e-2 at 131k): still
    # plain RoPE, so the kernels and the host/disk tiers keep their frequencies.
    from sglang.srt.layers.rotary_embedding import get_rope

    head = 128
    rope = get_rope(head, head, positions, int(theta), True, scaling, torch.float32)
    spec = rope_spec(find_rotary(torch.nn.Sequential(rope)), "cpu")
    assert spec.inv_freq is not None
    # The module's own fp32 frequencies, Llama-3 scaling included.
    assert torch.equal(spec.inv_freq, rope._compute_inv_freq(rope.base).float())
    # What the tiers do with them (rotate pre-RoPE keys by float64 angles) lands where
    # SGLang's module puts the key, up to the model's own fp32 angle rounding.
    g = torch.Generator().manual_seed(1)
    pre = torch.randn(4, 1, head, generator=g)
    pos = torch.tensor([0, 7, positions // 2 + 3, positions - 1])
    q = torch.zeros(4, head)
    _, at = rope.forward_native(pos, q, pre.reshape(4, head).clone())
    ours = apply_rope(pre, pos, spec.inv_freq)
    bound = 4 * float(pos.max()) * 6e-8 * float(pre.abs().max()) + 1e-5
    torch.testing.assert_close(ours.reshape(4, head), at, atol=bound, rtol=0)


def test_a_wrong_theta_does_not_fit_a_long_table() -> None:
    from sglang.srt.layers.rotary_embedding import get_rope

    rope = get_rope(128, 128, 32768, 1000000, True, None, torch.float32)
    table = rope_spec(rope, "cpu").cos_sin
    assert fits_table(table, default_inv_freq(128, 1e6))
    for theta in (1e6 * (1 + 1e-4), 1e6 * (1 - 1e-4), 5e5, 1e4):
        assert not fits_table(table, default_inv_freq(128, theta)), theta
    # A module whose base disagrees with its table: the table is what the model rotates
    # by, so its frequencies are the ones kept, not the base's.
    wrong = default_inv_freq(128, 5e5)
    got = plain_frequencies(table, hint=wrong)
    assert got is not None and not torch.allclose(got, wrong)
    torch.testing.assert_close(got, default_inv_freq(128, 1e6), rtol=2e-7, atol=0)


def test_a_table_that_switches_frequencies_has_none() -> None:
    # Rows past 4,096 from another theta (LongRoPE's short/long switch is of this kind):
    # no one frequency fits, so the kernels and the tiers must not claim one.
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    class Switched(RotaryEmbedding):
        def _compute_cos_sin_cache(self) -> torch.Tensor:
            short = ModelRope.plain(default_inv_freq(HEAD, 1e4), 4096).spec.cos_sin
            long = ModelRope.plain(default_inv_freq(HEAD, 1.1e4), 16384).spec.cos_sin
            return torch.cat([short, long[4096:]])

    rope = Switched(HEAD, HEAD, 16384, 10000, True, torch.float32)
    spec = rope_spec(rope, "cpu")
    assert spec.inv_freq is None and spec.cos_sin.shape == (16384, HEAD)
    assert plain_frequencies(spec.cos_sin[:4096]) is not None


def gemma3_like_layers(pattern: str) -> torch.nn.ModuleList:
    """Decoder layers as SGLang's Gemma 3 builds them: each attention holds the rotary of
    its kind, theta 10k for a sliding layer "s", 1M for a global "g", one module per kind
    (``get_rope`` caches them so; made here uncached, since another test casts a cached
    module's table)."""
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    kinds = {
        kind: RotaryEmbedding(HEAD, HEAD, 8192, base, True, torch.float32)
        for kind, base in (("s", 10000), ("g", 1_000_000))
    }
    layers = torch.nn.ModuleList()
    for kind in pattern:
        attn = torch.nn.Module()
        attn.rotary_emb = kinds[kind]
        layer = torch.nn.Module()
        layer.self_attn = attn
        layers.append(layer)
    return layers


def test_each_layer_moves_keys_by_its_own_table() -> None:
    layers = gemma3_like_layers("ssgsg")
    with pytest.raises(UnsupportedRope, match="different"):
        find_rotary(layers)  # one table for all: refused
    ropes = layer_ropes(layers, "cpu")
    groups = ropes.groups()
    assert [g[1] for g in groups] == [[0, 1, 3], [2, 4]]
    assert groups[0][0].spec.inv_freq is not None and groups[1][0].spec.inv_freq is not None
    assert not torch.equal(groups[0][0].spec.inv_freq, groups[1][0].spec.inv_freq)
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(N, HEADS, HEAD, generator=g)
    old = torch.randint(0, 500, (N,), generator=g)
    new = torch.randint(0, 4000, (N,), generator=g)
    for layer, rope in zip(layers, ropes.by_layer, strict=True):
        sglang = layer.self_attn.rotary_emb
        at_old, at_new = apply(sglang, keys, old), apply(sglang, keys, new)
        # fp32 tables: the model itself rounds angles at ~position * 6e-8.
        torch.testing.assert_close(rope.rotate(at_old, new - old), at_new, atol=1e-3, rtol=1e-3)
        other = next(r for r, _ in groups if r is not rope)
        assert not torch.allclose(other.rotate(at_old, new - old), at_new, atol=1e-2)


def test_a_layer_without_its_own_rotary_is_refused() -> None:
    layers = gemma3_like_layers("sg")
    layers.append(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedRope, match="decoder layer 2 holds 0"):
        layer_ropes(layers, "cpu")
