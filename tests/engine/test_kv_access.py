"""KVAccess over a pool: re-rotated writes and the pre-RoPE keys phase 1 hands the tiers."""

from __future__ import annotations

import pytest
import torch

from sgl_pic.engine.kv_access import KVAccess, SliceRun, slice_runs
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.rope import default_inv_freq, rotate_layers
from tests.support.fakes import FakePool, chunk_data

LAYERS, HEADS, DIM = 3, 2, 8
INV_FREQ = default_inv_freq(DIM, 10000.0)


def test_pre_rope_keys_undo_the_rotation_phase_1_applied() -> None:
    c = chunk_data(0, 12, LAYERS, HEADS, DIM, INV_FREQ)
    kv = KVAccess(FakePool(32, LAYERS, HEADS, DIM), LAYERS, ModelRope.plain(INV_FREQ))
    torch.testing.assert_close(kv.pre_rope_keys(c.kv), c.pre_k, atol=1e-5, rtol=1e-5)


def test_write_rotated_then_read_moves_keys_to_their_new_positions() -> None:
    c = chunk_data(1, 5, LAYERS, HEADS, DIM, INV_FREQ)
    kv = KVAccess(FakePool(32, LAYERS, HEADS, DIM), LAYERS, ModelRope.plain(INV_FREQ))
    slots = torch.tensor([7, 3, 20, 11, 5])
    kv.write_rotated(slots, c.kv, 9)
    back = kv.read(slots)
    expected = rotate_layers(c.pre_k, torch.arange(9, 14), INV_FREQ)
    torch.testing.assert_close(back[:, 0], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back[:, 1], c.v)


def _pool_with_chunks(dtype: torch.dtype) -> tuple[FakePool, list[torch.Tensor]]:
    """A pool holding two chunks' KV (keys at chunk positions 0..n-1) at node slots."""
    pool = FakePool(64, LAYERS, HEADS, DIM, dtype=dtype)
    # Chunk 2's slots follow chunk 0's: a copy of both must still rotate each its own way.
    node_slots = [torch.arange(40, 46), torch.tensor([50, 52, 54, 56]), torch.arange(46, 50)]
    for seed, slots in enumerate(node_slots):
        c = chunk_data(seed, slots.numel(), LAYERS, HEADS, DIM, INV_FREQ)
        for layer in range(LAYERS):
            pool.k_buffer[layer][slots] = c.kv[layer, 0].to(dtype)
            pool.v_buffer[layer][slots] = c.v[layer].to(dtype)
    return pool, node_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize(
    "path", ["per_layer", "all_layers", "table", "slices", "mixed", "table_slices"]
)
def test_copy_rotated_matches_a_copy_per_hit(dtype: torch.dtype, layout: str, path: str) -> None:
    """The batched copy of device hits writes what one read + write_rotated per hit did,
    whichever way it runs, and leaves the node slots as stored. The same chunk may serve
    twice (two requests of a batch), and a hit may start past the device prefix. Slice
    paths: every run of consecutive slots copied as a slice, or those of 4 rows and more
    (hits 0 and 2 as slices, the rest gathered)."""
    rope = ModelRope.plain(INV_FREQ, max_positions=256, layout=layout)  # type: ignore[arg-type]
    if path.startswith("table"):
        rope = ModelRope(rope.spec._replace(inv_freq=None))
    hits = [  # (node slots, request slots, chunk start)
        (0, torch.arange(0, 6), 3),
        (2, torch.arange(6, 10), 60),  # slots continue hit 0's on both sides
        (1, torch.tensor([9, 7, 11, 13]), 40),
        (0, torch.arange(20, 26), 120),
        (1, torch.tensor([31, 32]), 17),  # rows 2.. of the chunk: the prefix held 0 and 1
    ]
    want_pool, node_slots = _pool_with_chunks(dtype)
    want = KVAccess(want_pool, LAYERS, rope)
    for chunk, dst, start in hits:
        src = node_slots[chunk][-dst.numel() :]
        want.write_rotated(dst, want.read(src), start + node_slots[chunk].numel() - dst.numel())

    pool, node_slots = _pool_with_chunks(dtype)
    nodes_before = [torch.stack([pool.k_buffer[i][s] for i in range(LAYERS)]) for s in node_slots]
    got = KVAccess(pool, LAYERS, rope)
    got.per_layer_copies = path != "all_layers"
    got.slice_rows = {"slices": 1, "table_slices": 1, "mixed": 4}.get(path, 1000)
    src = [node_slots[c][-d.numel() :] for c, d, _ in hits]
    delta = [torch.full((d.numel(),), s + node_slots[c].numel() - d.numel()) for c, d, s in hits]
    got.copy_rotated(torch.cat(src), torch.cat([d for _, d, _ in hits]), torch.cat(delta))

    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    for layer in range(LAYERS):
        torch.testing.assert_close(pool.k_buffer[layer], want_pool.k_buffer[layer], **tol)
        torch.testing.assert_close(pool.v_buffer[layer], want_pool.v_buffer[layer], rtol=0, atol=0)
    for slots, before in zip(node_slots, nodes_before, strict=True):
        after = torch.stack([pool.k_buffer[i][slots] for i in range(LAYERS)])
        torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_copy_rotated_moves_keys_to_their_new_positions() -> None:
    """Against the RoPE math itself: node keys at 0..n-1 land at start..start+n-1."""
    pool, node_slots = _pool_with_chunks(torch.float32)
    kv = KVAccess(pool, LAYERS, ModelRope.plain(INV_FREQ))
    c = chunk_data(0, 6, LAYERS, HEADS, DIM, INV_FREQ)
    dst = torch.arange(0, 6)
    kv.copy_rotated(node_slots[0], dst, torch.full((6,), 33))
    back = kv.read(dst)
    expected = rotate_layers(c.pre_k, torch.arange(33, 39), INV_FREQ)
    torch.testing.assert_close(back[:, 0], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back[:, 1], c.v)


def test_slice_runs_split_at_a_slot_gap_or_a_new_delta() -> None:
    # Rows 0-2: slots 10.. -> 0.., delta 5; rows 3-4 continue both slot ranges with a new
    # delta; row 5 jumps in the source; rows 6-8: slots 30.. -> 6.., delta 2.
    src = torch.tensor([10, 11, 12, 13, 14, 20, 30, 31, 32])
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    delta = torch.tensor([5, 5, 5, 7, 7, 7, 2, 2, 2])
    got = slice_runs(src, dst, delta, min_rows=3)
    assert got.runs == [SliceRun(10, 0, 3, 5), SliceRun(30, 6, 3, 2)]
    assert got.rest.tolist() == [3, 4, 5]
    every = slice_runs(src, dst, delta, min_rows=1)
    assert [r.rows for r in every.runs] == [3, 2, 1, 3] and every.rest.numel() == 0
    none = slice_runs(src, dst, delta, min_rows=4)
    assert none.runs == [] and none.rest.tolist() == list(range(9))
    empty = slice_runs(src[:0], dst[:0], delta[:0], min_rows=1)
    assert empty.runs == [] and empty.rest.numel() == 0
