"""The pool ops against plain torch indexing and ``sgl_pic.rope``, on CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

import sgl_pic.ops as ops
from sgl_pic.rope import default_inv_freq, rotate_layers

L, SLOTS, H, D = 3, 40, 2, 16
INV_FREQ = default_inv_freq(D, 10000.0)


class ToyPool:
    """Per-layer K and V buffers, SGLang-style (separate tensors per layer)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:  # each [L, SLOTS, H, D]
        self.k = [t.clone() for t in k.unbind(0)]
        self.v = [t.clone() for t in v.unbind(0)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.k), torch.stack(self.v)


@pytest.fixture
def pool(rand_kv) -> ToyPool:
    return ToyPool(rand_kv(L, SLOTS, H, D), rand_kv(L, SLOTS, H, D))


def test_read_copies_k_and_v_of_every_layer(pool, distinct) -> None:
    slots = distinct(7, SLOTS)
    got = ops.read_pool_kv(pool, L, slots)
    k, v = pool.snapshot()
    assert got.shape == (L, 2, 7, H, D)
    assert torch.equal(got[:, 0], k[:, slots]) and torch.equal(got[:, 1], v[:, slots])
    got.zero_()  # a copy: the pool is untouched
    assert torch.equal(pool.snapshot()[0], k)


def test_write_scatters_k_and_v_and_nothing_else(pool, rand_kv, distinct) -> None:
    slots = distinct(9, SLOTS)
    kv = rand_kv(L, 2, 9, H, D)
    k, v = pool.snapshot()
    k[:, slots], v[:, slots] = kv[:, 0], kv[:, 1]
    assert ops.write_pool_kv(pool, L, slots, kv).backend == "reference"
    got_k, got_v = pool.snapshot()
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_write_casts_to_the_pool_dtype(rand_kv, distinct) -> None:
    pool = ToyPool(rand_kv(L, SLOTS, H, D, dtype=torch.bfloat16), rand_kv(L, SLOTS, H, D))
    pool.v = [t.bfloat16() for t in pool.v]
    slots = distinct(4, SLOTS)
    kv = rand_kv(L, 2, 4, H, D)
    ops.write_pool_kv(pool, L, slots, kv)
    assert torch.equal(pool.snapshot()[0][:, slots], kv[:, 0].bfloat16())


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_rotate_pool_keys_moves_only_those_slots(pool, distinct, gen, layout) -> None:
    slots = distinct(6, SLOTS)
    delta = torch.randint(-500, 500, (6,), generator=gen)
    k, v = pool.snapshot()
    want = k.clone()
    want[:, slots] = rotate_layers(k[:, slots], delta, INV_FREQ, layout)
    assert ops.rotate_pool_keys(pool, L, slots, delta, INV_FREQ, layout).backend == "reference"
    got_k, got_v = pool.snapshot()
    torch.testing.assert_close(got_k, want, atol=1e-5, rtol=0)
    assert torch.equal(got_v, v)
    assert not torch.equal(got_k[:, slots], k[:, slots])


def test_rotated_keys_of_a_kv_view_is_a_new_tensor(rand_kv, gen) -> None:
    kv = rand_kv(L, 2, 8, H, D)
    before = kv.clone()
    delta = torch.randint(-100, 100, (8,), generator=gen)
    got = ops.rotated_keys(kv[:, 0], delta, INV_FREQ, "neox")
    torch.testing.assert_close(got, rotate_layers(kv[:, 0], delta, INV_FREQ), atol=1e-5, rtol=0)
    assert torch.equal(kv, before)
    # Round trip: rotating back restores the keys.
    torch.testing.assert_close(ops.rotated_keys(got, -delta, INV_FREQ), kv[:, 0], atol=1e-4, rtol=0)


def test_kv_views_are_taken_without_a_copy_but_overlaps_are_not(rand_kv, distinct) -> None:
    kv = rand_kv(L, 2, 5, H, D)
    pool = rand_kv(L, SLOTS, H, D)
    slots = distinct(5, SLOTS)
    ops.scatter_kv(kv[:, 1], pool, slots)  # strided layers: accepted
    assert torch.equal(pool[:, slots], kv[:, 1])
    overlapping = rand_kv(1, 5, H, D).expand(L, 5, H, D)
    with pytest.raises(ValueError, match="contiguous within each layer"):
        ops.scatter_kv(overlapping, pool, slots)
    with pytest.raises(ValueError, match="contiguous within each layer"):
        ops.scatter_kv(kv[:, :, :, 0], pool[..., :1, :].contiguous(), slots)


def test_out_of_range_slots_raise_before_anything_runs(pool, rand_kv) -> None:
    k, v = pool.snapshot()
    bad = torch.tensor([0, SLOTS])
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.read_pool_kv(pool, L, bad)
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.write_pool_kv(pool, L, bad, rand_kv(L, 2, 2, H, D))
    with pytest.raises(ValueError, match="slot_ids out of range"):
        ops.rotate_pool_keys(pool, L, bad, torch.tensor([1, 2]), INV_FREQ)
    with pytest.raises(ValueError, match="num_layers, 2, n"):
        ops.write_pool_kv(pool, L, bad, rand_kv(L, 3, 2, H, D))
    got_k, got_v = pool.snapshot()
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pool_ops_match_the_cpu_result(rand_kv, distinct, gen, dtype) -> None:
    from sgl_pic.ops import cuda

    assert cuda.prepare(torch.device("cuda")).available  # the server prepares them at start-up
    k, v = rand_kv(L, SLOTS, H, D, dtype=dtype), rand_kv(L, SLOTS, H, D, dtype=dtype)
    cpu, gpu = ToyPool(k, v), ToyPool(k.cuda(), v.cuda())
    slots = distinct(11, SLOTS)
    kv = rand_kv(L, 2, 11, H, D, dtype=dtype)
    delta = torch.randint(-3000, 3000, (11,), generator=gen)
    for pool, rows, dev in ((cpu, kv, "cpu"), (gpu, kv.pin_memory(), "cuda")):
        result = ops.write_pool_kv(pool, L, slots.to(dev), rows)
        assert result.backend == ("cuda" if dev == "cuda" else "reference")
        assert ops.rotate_pool_keys(pool, L, slots, delta, INV_FREQ).backend == result.backend
    torch.cuda.synchronize()
    (ck, cv), (gk, gv) = cpu.snapshot(), gpu.snapshot()
    assert torch.equal(gv.cpu(), cv)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(gk.cpu(), ck, **tol)
    read = ops.read_pool_kv(gpu, L, slots.cuda())
    assert read.is_cuda and torch.equal(read.cpu(), ops.read_pool_kv(cpu, L, slots))
