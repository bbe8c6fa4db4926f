"""CUDA kernels against the torch reference, on a GPU only.

Each case runs the public op (which must pick the kernel) and the reference on clones
of the same fresh random data. Copies must match bit for bit; RoPE within float32
rounding of cos/sin (one unit in the last place of fp16/bf16 at most).
"""

from __future__ import annotations

import pytest
import torch

import sgl_pic.ops as ops
from sgl_pic.ops import cuda, reference
from sgl_pic.rope import default_inv_freq

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
DEV = "cuda"
# (num_kv_heads, head_dim): SmolLM2's 3 x 64, a large 8 x 128, rows that fall back to
# narrower vectors (6 and 2 fp16 elements), and rows wider than a block (8 x 512 fp32).
ROW_SHAPES = [(3, 64), (8, 128), (1, 6), (1, 2), (8, 512)]


@pytest.fixture(scope="module", autouse=True)
def kernels_loaded() -> None:
    # Builds, loads and launch-tests once per process, as a server's start-up does; a
    # failure here is a test failure, not a skip.
    state = cuda.prepare(torch.device(DEV))
    assert state.available, state.reason
    cuda.require()


def _rope_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, expected)  # dtype tolerances: about one ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "head_dim"), ROW_SHAPES)
@pytest.mark.parametrize("as_list", [False, True])
def test_gather_matches_reference(dtype, heads, head_dim, as_list, rand_kv, distinct) -> None:
    src = rand_kv(3, 300, heads, head_dim, dtype=dtype, device=DEV)
    pool = rand_kv(3, 500, heads, head_dim, dtype=dtype, device=DEV)
    tokens, slots = distinct(257, 300).to(DEV), distinct(257, 500).to(DEV)
    expected = pool.clone()
    reference.gather_kv(src, tokens, expected, slots)
    got = list(pool.clone().unbind(0)) if as_list else pool.clone()
    assert ops.gather_kv(src, tokens, got, slots).backend == "cuda"
    assert torch.equal(torch.stack(list(got)) if as_list else got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_from_pinned_host(dtype, rand_kv, distinct) -> None:
    src = rand_kv(2, 1000, 3, 64, dtype=dtype).pin_memory()
    pool = rand_kv(2, 1200, 3, 64, dtype=dtype, device=DEV)
    tokens, slots = distinct(850, 1000), distinct(850, 1200).to(DEV)
    expected = pool.clone()
    reference.gather_kv(src, tokens, expected, slots)
    assert ops.gather_kv(src, tokens, pool, slots).backend == "cuda"
    torch.cuda.synchronize()
    assert torch.equal(pool, expected)
    # One layer straight from host memory too.
    layer = pool[1].clone()
    assert ops.gather_kv_layer(src[0], tokens, layer, slots).backend == "cuda"
    assert torch.equal(layer[slots], src[0][tokens].to(DEV))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "head_dim"), ROW_SHAPES)
def test_scatter_matches_reference(dtype, heads, head_dim, rand_kv, distinct) -> None:
    rows = rand_kv(2, 77, heads, head_dim, dtype=dtype, device=DEV)
    pool = rand_kv(2, 90, heads, head_dim, dtype=dtype, device=DEV)
    slots = distinct(77, 90).to(DEV)
    expected = pool.clone()
    reference.scatter_kv(rows, expected, slots)
    got = list(pool.clone().unbind(0))
    assert ops.scatter_kv(rows, got, slots).backend == "cuda"
    assert torch.equal(torch.stack(got), expected)
    layer = pool[0].clone()
    assert ops.scatter_kv_layer(rows[1], layer, slots).backend == "cuda"
    assert torch.equal(layer[slots], rows[1])


def test_copy_into_misaligned_view(rand_kv, distinct) -> None:
    # A view starting 12 bytes into its storage forces 4-byte accesses.
    storage = rand_kv(41, 1, 6, dtype=torch.float16, device=DEV)
    pool = storage[1:]
    rows = rand_kv(10, 1, 6, dtype=torch.float16, device=DEV)
    slots = distinct(10, 40).to(DEV)
    before = storage[0].clone()
    assert ops.scatter_kv_layer(rows, pool, slots).backend == "cuda"
    assert torch.equal(pool[slots], rows)
    assert torch.equal(storage[0], before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize(("heads", "head_dim"), [(3, 64), (8, 128), (2, 66), (1, 2), (4, 1024)])
def test_apply_rope_matches_reference(dtype, layout, heads, head_dim, rand_kv, gen, distinct):
    k = rand_kv(2, 200, heads, head_dim, dtype=dtype, device=DEV)
    slots = distinct(150, 200).to(DEV)
    positions = torch.randint(0, 3_000_000, (150,), generator=gen).to(DEV)
    inv_freq = default_inv_freq(head_dim, 500000.0, device=torch.device(DEV))
    expected = k.clone()
    reference.apply_rope_kv(expected, positions, inv_freq, layout, 0.9, slot_ids=slots)
    got = list(k.clone().unbind(0))
    result = ops.apply_rope_kv(got, positions, inv_freq, layout, 0.9, slot_ids=slots)
    assert result.backend == "cuda"
    _rope_close(torch.stack(got), expected)

    whole = k[0].clone()
    all_positions = torch.randint(0, 40_000, (200,), generator=gen, dtype=torch.int32).to(DEV)
    assert ops.apply_rope_kv_layer(whole, all_positions, inv_freq, layout).backend == "cuda"
    _rope_close(whole, reference_layer_rope(k[0], all_positions, inv_freq, layout))


def reference_layer_rope(k, positions, inv_freq, layout):
    out = k.clone()
    reference.apply_rope_kv_layer(out, positions, inv_freq, layout)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_rerotate_matches_reference(dtype, layout, rand_kv, gen, distinct) -> None:
    k = rand_kv(4, 300, 3, 64, dtype=dtype, device=DEV)
    slots = distinct(120, 300).to(DEV)
    old = torch.randint(0, 2_000_000, (120,), generator=gen).to(DEV)
    new = torch.randint(0, 2_000_000, (120,), generator=gen).to(DEV)
    inv_freq = default_inv_freq(64, 10000.0, device=torch.device(DEV))
    expected = k.clone()
    reference.rerotate_kv(expected, old, new, inv_freq, layout, slot_ids=slots)
    assert ops.rerotate_kv(k, old, new, inv_freq, layout, slot_ids=slots).backend == "cuda"
    _rope_close(k, expected)


def test_out_of_range_raises_and_writes_nothing(rand_kv) -> None:
    pool = rand_kv(2, 10, 3, 64, device=DEV)
    before = pool.clone()
    rows = rand_kv(2, 2, 3, 64, device=DEV)
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.scatter_kv(rows, pool, torch.tensor([3, 10], device=DEV))
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.apply_rope_kv(
            pool, torch.tensor([1, 2]), default_inv_freq(64, 1e4), slot_ids=torch.tensor([-1, 2])
        )
    assert torch.equal(pool, before)


def test_runs_on_the_current_stream(rand_kv, distinct) -> None:
    src = rand_kv(2, 4000, 8, 128, dtype=torch.bfloat16, device=DEV)
    tokens, slots = distinct(3000, 4000).to(DEV), distinct(3000, 4000).to(DEV)
    expected = src.clone()
    reference.gather_kv(src, tokens, expected, slots)
    pool = src.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Keep the default stream busy: a kernel wrongly launched there would run after the
    # side stream's clone below, which would then miss the gathered rows.
    torch.cuda._sleep(200_000_000)
    with torch.cuda.stream(side):
        ops.gather_kv(src, tokens, pool, slots)
        done = pool.clone()
    torch.cuda.synchronize()
    assert torch.equal(done, expected)


def test_empty_index_is_a_no_op(rand_kv) -> None:
    pool = rand_kv(2, 10, 3, 64, device=DEV)
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    assert ops.scatter_kv(pool[:, :0].contiguous(), pool, empty).backend == "cuda"
    assert torch.equal(pool, before)
