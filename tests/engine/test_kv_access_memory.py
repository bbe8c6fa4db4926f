"""``KVAccess.copy_rotated`` stays within its staging bound however many tokens a batch
reuses, and writes exactly what one unbounded read, rotation and write of every row did."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.ops import write_pool_kv
from sgl_pic.rope import default_inv_freq
from tests.support.fakes import FakePool

LAYERS, HEADS, DIM, SLOTS = 2, 4, 64, 8192
INV_FREQ = default_inv_freq(DIM, 10000.0)
STAGING = 256 << 10
HIT_ROWS = 3000
# Index bookkeeping the copy may hold per row besides staged KV (int64 slots, deltas and
# the CPU path's run split): a few words, not a row of K/V (a KiB here, 2-4 KiB in models).
INDEX_BYTES_PER_ROW = 64


def peak_bytes(fn: Callable[[], None]) -> int:
    """The most bytes ``fn`` held allocated at once beyond what existed before, from
    torch's CPU memory profiler (allocations counted when their op starts, frees when
    they happen, so the figure errs high)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = most = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        now += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        most = max(most, now)
    return most


def large_hit(dtype: torch.dtype) -> tuple[FakePool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool with random KV and HIT_ROWS rows to copy from scattered node slots into
    scattered request slots (no runs of consecutive slots), with a few deltas."""
    g = torch.Generator().manual_seed(0)
    pool = FakePool(SLOTS, LAYERS, HEADS, DIM, dtype=dtype)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    perm = torch.randperm(SLOTS - 1, generator=g) + 1
    src, dst = perm[:HIT_ROWS], perm[HIT_ROWS : 2 * HIT_ROWS]
    delta = torch.randint(0, 4000, (4,), generator=g).repeat_interleave(HIT_ROWS // 4)
    return pool, src, dst, delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on_device", [True, False], ids=["device_path", "cpu_path"])
def test_copy_rotated_stages_a_bounded_amount_and_matches_the_unbounded_copy(
    dtype: torch.dtype, on_device: bool
) -> None:
    rope = ModelRope.plain(INV_FREQ, max_positions=8192)
    want_pool, src, dst, delta = large_hit(dtype)
    want = KVAccess(want_pool, LAYERS, rope)
    kv = want.read(src)  # every row of every layer at once: the unbounded reference
    want.rotate_in_place(kv[:, 0], delta)
    write_pool_kv(want_pool, LAYERS, dst, kv)
    unbounded = kv.numel() * kv.element_size()
    del kv

    pool, *_ = large_hit(dtype)
    nodes_before = [pool.k_buffer[i][src].clone() for i in range(LAYERS)]
    got = KVAccess(pool, LAYERS, rope, staging_bytes=STAGING)
    # The device path (every row gathered, the ops rotating) runs here on the CPU pool.
    got.per_layer_copies = not on_device
    peak = peak_bytes(lambda: got.copy_rotated(src, dst, delta))

    assert unbounded > 20 * STAGING  # the hit is large against the bound
    assert peak <= STAGING + INDEX_BYTES_PER_ROW * HIT_ROWS, (peak, STAGING)
    for layer in range(LAYERS):
        assert torch.equal(pool.k_buffer[layer], want_pool.k_buffer[layer])
        assert torch.equal(pool.v_buffer[layer], want_pool.v_buffer[layer])
        assert torch.equal(pool.k_buffer[layer][src], nodes_before[layer])  # nodes as stored


def test_piece_rows_follow_the_staging_bound_and_one_row_is_the_least() -> None:
    pool = FakePool(16, LAYERS, HEADS, DIM)
    rope = ModelRope.plain(INV_FREQ)
    row = HEADS * DIM * 4
    assert KVAccess(pool, LAYERS, rope, staging_bytes=100 * 5 * row).piece_rows == 100
    assert KVAccess(pool, LAYERS, rope, staging_bytes=1).piece_rows == 1
    with pytest.raises(ValueError, match="staging_bytes"):
        KVAccess(pool, LAYERS, rope, staging_bytes=0)


def test_copy_rotated_refuses_slots_outside_the_pool_before_writing() -> None:
    pool = FakePool(16, LAYERS, HEADS, DIM)
    before = pool.snapshot()
    kv = KVAccess(pool, LAYERS, ModelRope.plain(INV_FREQ))
    kv.per_layer_copies = False
    with pytest.raises(ValueError, match="dst out of range"):
        kv.copy_rotated(torch.tensor([1, 2]), torch.tensor([3, 16]), torch.tensor([0, 0]))
    assert all(torch.equal(a, b) for a, b in zip(pool.snapshot(), before, strict=True))
