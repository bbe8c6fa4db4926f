"""The torch references against independent formulas: explicit loops for the copies,
complex rotation in float64 for RoPE, and encoding at the new position for rerotation."""

from __future__ import annotations

import pytest
import torch

from sgl_pic.ops import reference
from sgl_pic.rope import apply_rope, default_inv_freq

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


def _expected_copy(
    src: torch.Tensor,  # [num_layers, num_src, H, D]
    token_ids: list[int],
    dst: torch.Tensor,  # [num_layers, num_slots, H, D]
    slot_ids: list[int],
) -> torch.Tensor:
    out = dst.clone()
    for layer in range(src.shape[0]):
        for t, s in zip(token_ids, slot_ids, strict=True):
            out[layer, s] = src[layer, t]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("as_list", [False, True])
def test_gather_matches_loop(dtype, as_list, rand_kv, distinct) -> None:
    src = rand_kv(3, 40, 2, 16, dtype=dtype)
    dst = rand_kv(3, 64, 2, 16, dtype=dtype)
    token_ids, slot_ids = distinct(25, 40), distinct(25, 64)
    expected = _expected_copy(src, token_ids.tolist(), dst, slot_ids.tolist())
    target = list(dst.clone().unbind(0)) if as_list else dst.clone()
    result = reference.gather_kv(src, token_ids, target, slot_ids)
    got = torch.stack(target) if as_list else target
    assert result.backend == "reference"
    assert torch.equal(got, expected)


def test_gather_layer_int32_indices(rand_kv, distinct) -> None:
    src, dst = rand_kv(30, 3, 64, dtype=torch.bfloat16), rand_kv(50, 3, 64, dtype=torch.bfloat16)
    token_ids, slot_ids = distinct(12, 30).int(), distinct(12, 50).int()
    expected = _expected_copy(src[None], token_ids.tolist(), dst[None], slot_ids.tolist())[0]
    reference.gather_kv_layer(src, token_ids, dst, slot_ids)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scatter_matches_loop(dtype, rand_kv, distinct) -> None:
    rows = rand_kv(2, 9, 4, 8, dtype=dtype)
    dst = rand_kv(2, 33, 4, 8, dtype=dtype)
    slot_ids = distinct(9, 33)
    expected = _expected_copy(rows, list(range(9)), dst, slot_ids.tolist())
    reference.scatter_kv(rows, dst, slot_ids)
    assert torch.equal(dst, expected)

    layer_rows, layer_dst = rows[0].clone(), dst[1].clone()
    reference.scatter_kv_layer(layer_rows, layer_dst, slot_ids)
    assert torch.equal(layer_dst[slot_ids], layer_rows)


def test_empty_indices_change_nothing(rand_kv) -> None:
    src, dst = rand_kv(2, 5, 1, 8), rand_kv(2, 7, 1, 8)
    before = dst.clone()
    empty = torch.empty(0, dtype=torch.int64)
    reference.gather_kv(src, empty, dst, empty)
    reference.apply_rope_kv(dst, empty, default_inv_freq(8, 1e4), slot_ids=empty)
    assert torch.equal(dst, before)


def _complex_rope(
    x: torch.Tensor,  # [n, H, D] float
    positions: torch.Tensor,  # [n]
    inv_freq: torch.Tensor,  # [D // 2]
    layout: str,
    scale: float,
) -> torch.Tensor:
    """RoPE as multiplication of each pair, read as a complex number, by
    scale * exp(i * position * freq), in float64."""
    x = x.to(torch.float64)
    half = x.shape[-1] // 2
    if layout == "neox":
        z = torch.complex(x[..., :half], x[..., half:])
    else:
        z = torch.complex(x[..., 0::2], x[..., 1::2])
    angle = positions.to(torch.float64)[:, None, None] * inv_freq.to(torch.float64)
    z = z * scale * torch.exp(1j * angle)
    if layout == "neox":
        return torch.cat([z.real, z.imag], dim=-1)
    return torch.stack([z.real, z.imag], dim=-1).flatten(-2)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_apply_rope_matches_complex_rotation(layout, scale, rand_kv, gen, distinct) -> None:
    k = rand_kv(2, 50, 3, 32)
    inv_freq = default_inv_freq(32, 10000.0)
    slot_ids = distinct(20, 50)
    positions = torch.randint(0, 200_000, (20,), generator=gen)
    expected = k.clone()
    for layer in range(2):
        expected[layer, slot_ids] = _complex_rope(
            k[layer, slot_ids], positions, inv_freq, layout, scale
        ).float()
    reference.apply_rope_kv(k, positions, inv_freq, layout, scale, slot_ids=slot_ids)
    torch.testing.assert_close(k, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_apply_rope_all_rows_equals_rope_module(dtype, layout, rand_kv, gen) -> None:
    k = rand_kv(17, 2, 64, dtype=dtype)
    positions = torch.randint(0, 4096, (17,), generator=gen, dtype=torch.int32)
    inv_freq = default_inv_freq(64, 500000.0)
    expected = apply_rope(k, positions, inv_freq, layout)
    layers = [k.clone(), k.clone()]
    reference.apply_rope_kv(layers, positions, inv_freq, layout)
    assert torch.equal(layers[0], expected)
    assert torch.equal(layers[1], expected)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_apply_rope_over_a_stacked_kv_view_rotates_every_layer_and_only_keys(
    layout, rand_kv, gen
) -> None:
    # A chunk's KV as the executor holds it: keys are kv[:, 0], whose layers lie apart.
    kv = torch.stack([rand_kv(4, 9, 2, 16), rand_kv(4, 9, 2, 16)], dim=1)
    before = kv.clone()
    inv_freq = default_inv_freq(16, 10000.0)
    positions = torch.randint(-500, 500, (9,), generator=gen)
    reference.apply_rope_kv(kv[:, 0], positions, inv_freq, layout)
    for layer in range(4):
        expected = _complex_rope(before[layer, 0], positions, inv_freq, layout, 1.0).float()
        torch.testing.assert_close(kv[layer, 0], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(kv[:, 1], before[:, 1])


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_rerotation_equals_encoding_at_new_position(layout, rand_kv, gen, distinct) -> None:
    raw = rand_kv(40, 3, 64)
    inv_freq = default_inv_freq(64, 10000.0)
    old = torch.randint(0, 100_000, (40,), generator=gen)
    new = torch.randint(0, 100_000, (40,), generator=gen)
    k = apply_rope(raw, old, inv_freq, layout)
    reference.rerotate_kv_layer(k, old, new, inv_freq, layout)
    torch.testing.assert_close(k, apply_rope(raw, new, inv_freq, layout), rtol=1e-5, atol=1e-5)

    # At slots, in every layer: only the named rows move.
    pool = torch.stack([apply_rope(raw, old, inv_freq, layout)] * 2)
    slots = distinct(15, 40)
    reference.rerotate_kv(pool, old[slots], new[slots], inv_freq, layout, slot_ids=slots)
    moved = old.clone()
    moved[slots] = new[slots]
    expected = apply_rope(raw, moved, inv_freq, layout)
    for layer in range(2):
        torch.testing.assert_close(pool[layer], expected, rtol=1e-5, atol=1e-5)
