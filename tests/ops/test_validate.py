"""Boundary checks: every bad argument raises a clear error before anything is written."""

from __future__ import annotations

import pytest
import torch

import sgl_pic.ops as ops
from sgl_pic.rope import default_inv_freq

I64 = torch.int64


@pytest.fixture
def kv(rand_kv):
    """(src # [2, 10, 3, 8], dst # [2, 20, 3, 8]) float16 and dst's copy before the call."""
    src = rand_kv(2, 10, 3, 8, dtype=torch.float16)
    dst = rand_kv(2, 20, 3, 8, dtype=torch.float16)
    return src, dst, dst.clone()


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


@pytest.mark.parametrize(
    ("token_ids", "slot_ids", "match"),
    [
        (_ids(0, 10), _ids(0, 1), r"token_ids out of range: values in \[0, 10\]"),
        (_ids(0, -1), _ids(0, 1), r"token_ids out of range"),
        (_ids(0, 1), _ids(0, 20), r"slot_ids out of range: values in \[0, 20\], valid \[0, 20\)"),
        (_ids(0, 1), _ids(-3, 1), r"slot_ids out of range"),
        (_ids(0, 1, 2), _ids(0, 1), r"3 token_ids for 2 slot_ids"),
        (_ids(0, 1).float(), _ids(0, 1), r"token_ids has dtype torch.float32"),
        (_ids(0, 1), _ids(0, 1)[None], r"slot_ids must be 1-D"),
    ],
)
def test_gather_rejects_bad_indices(kv, token_ids, slot_ids, match) -> None:
    src, dst, before = kv
    with pytest.raises(ValueError, match=match):
        ops.gather_kv(src, token_ids, dst, slot_ids)
    assert torch.equal(dst, before)


def test_gather_rejects_bad_tensors(kv, rand_kv) -> None:
    src, dst, before = kv
    ids = _ids(1, 2)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        ops.gather_kv(src.double(), ids, dst.double(), ids)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        ops.gather_kv(src.int(), ids, dst.int(), ids)
    with pytest.raises(ValueError, match="src is torch.float32 but dst is torch.float16"):
        ops.gather_kv(src.float(), ids, dst, ids)
    with pytest.raises(ValueError, match=r"\[num_kv_heads, head_dim\] = \[3, 4\]"):
        ops.gather_kv(src[..., :4].contiguous(), ids, dst, ids)
    with pytest.raises(ValueError, match="src has 1 layers but dst has 2"):
        ops.gather_kv(src[:1], ids, dst, ids)
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.gather_kv(src, ids, dst.transpose(1, 2).contiguous().transpose(1, 2), ids)
    with pytest.raises(ValueError, match="must have 4 dims"):
        ops.gather_kv(src[0], ids, dst, ids)
    with pytest.raises(ValueError, match=r"dst\[1\] is \(21, 3, 8\)"):
        ops.gather_kv(src, ids, [dst[0], rand_kv(21, 3, 8, dtype=torch.float16)], ids)
    with pytest.raises(ValueError, match="non-empty sequence"):
        ops.gather_kv(src, ids, [], ids)
    with pytest.raises(ValueError, match="on meta; it must be on dst's cpu or the CPU"):
        ops.gather_kv(src.to("meta"), ids, dst, ids)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ops.gather_kv_layer(src[0].tolist(), ids, dst[0], ids)
    assert torch.equal(dst, before)


def test_scatter_rejects_mismatched_rows(kv) -> None:
    src, dst, before = kv
    with pytest.raises(ValueError, match="10 rows for 3 slot_ids"):
        ops.scatter_kv(src, dst, _ids(1, 2, 3))
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.scatter_kv_layer(src[0, :2], dst[0], _ids(1, 99))
    assert torch.equal(dst, before)


def test_rope_rejects_bad_arguments(kv) -> None:
    _, dst, before = kv
    inv_freq = default_inv_freq(8, 10000.0)
    pos = _ids(*range(20))
    with pytest.raises(ValueError, match="partial rotary embedding is not supported"):
        ops.apply_rope_kv(dst, pos, default_inv_freq(4, 10000.0))
    with pytest.raises(ValueError, match="partial rotary embedding is not supported"):
        ops.rerotate_kv_layer(dst[0], pos, pos, inv_freq[:2])
    with pytest.raises(ValueError, match="unknown RoPE layout 'gptj'"):
        ops.apply_rope_kv(dst, pos, inv_freq, layout="gptj")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"positions must have shape \[20\]"):
        ops.apply_rope_kv(dst, pos[:5], inv_freq)
    with pytest.raises(ValueError, match=r"positions must have shape \[2\]"):
        ops.apply_rope_kv(dst, pos, inv_freq, slot_ids=_ids(0, 1))
    with pytest.raises(ValueError, match="positions must be int32 or int64"):
        ops.apply_rope_kv_layer(dst[0], pos.float(), inv_freq)
    with pytest.raises(ValueError, match=r"new_positions must have shape \[20\]"):
        ops.rerotate_kv(dst, pos, pos[:3], inv_freq)
    with pytest.raises(ValueError, match="old_positions must have shape"):
        ops.rerotate_kv(dst, pos[:3], pos, inv_freq)
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.apply_rope_kv(dst, _ids(1, 2), inv_freq, slot_ids=_ids(0, 20))
    with pytest.raises(ValueError, match="inv_freq has dtype torch.int64"):
        ops.apply_rope_kv(dst, pos, _ids(1, 2, 3, 4))
    with pytest.raises(ValueError, match="scale must be a finite number"):
        ops.apply_rope_kv(dst, pos, inv_freq, scale=float("nan"))
    assert torch.equal(dst, before)
