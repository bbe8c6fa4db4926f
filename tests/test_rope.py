"""rotate_with: writing into given rows, and one row of angles for every token."""

from __future__ import annotations

import pytest
import torch

from sgl_pic.rope import apply_rope, default_inv_freq, rope_cos_sin, rotate_with

INV_FREQ = default_inv_freq(16, 10000.0)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_rotate_with_into_rows_equals_a_new_tensor(layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=g)
    pool = torch.zeros(12, 2, 16)
    cos, sin = rope_cos_sin(torch.arange(3, 8), INV_FREQ)
    got = rotate_with(x, cos, sin, layout, out=pool[4:9])  # type: ignore[arg-type]
    assert got.data_ptr() == pool[4:9].data_ptr()
    want = rotate_with(x, cos, sin, layout)  # type: ignore[arg-type]
    torch.testing.assert_close(pool[4:9], want, rtol=0, atol=0)
    assert not pool[:4].any() and not pool[9:].any()
    torch.testing.assert_close(want, apply_rope(x, torch.arange(3, 8), INV_FREQ, layout))  # type: ignore[arg-type]


def test_one_row_of_angles_rotates_every_token_alike() -> None:
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))
    one = rope_cos_sin(torch.tensor([9]), INV_FREQ)
    each = rope_cos_sin(torch.full((6,), 9), INV_FREQ)
    torch.testing.assert_close(rotate_with(x, *one), rotate_with(x, *each), rtol=0, atol=0)
