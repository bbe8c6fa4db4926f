"""KVAccess over a pool: re-rotated writes and the pre-RoPE keys phase 1 hands the tiers."""

from __future__ import annotations

import torch

from sgl_pic.integration.kv_access import KVAccess
from sgl_pic.integration.model_rope import ModelRope
from sgl_pic.rope import default_inv_freq, rotate_layers
from tests.integration.fakes import FakePool, chunk_data

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
