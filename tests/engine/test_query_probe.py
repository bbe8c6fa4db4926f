"""``QueryProbe`` scores the prompt's keys a tile at a time within its staging bound, with
the scores of one pass over all of them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_pic.engine.query_probe import LOGIT_COPIES, QueryProbe, probe_tile
from tests.support.fakes import FakePool

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 16


def scores(staging_bytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    pool = FakePool(300, LAYERS, KV_HEADS, DIM)
    pool.k_buffer = [torch.randn(b.shape, generator=g) for b in pool.k_buffer]
    slots = torch.randperm(299, generator=g)[:200] + 1
    probe = QueryProbe(
        pool,
        slots,
        torch.tensor([0, 2, 3]),
        torch.tensor([150, 198, 199]),
        LAYERS,
        staging_bytes=staging_bytes,
    )
    for layer in range(LAYERS):
        attn = SimpleNamespace(tp_q_head_num=HEADS, qk_head_dim=DIM, layer_id=layer, scaling=0.3)
        probe.after_attention(layer, attn, torch.randn(4, HEADS * DIM, generator=g))
    return probe.scores


def test_a_tiled_probe_scores_as_one_pass() -> None:
    whole = scores(1 << 30)
    rows, key_row = HEADS * 3, KV_HEADS * DIM * 4
    small = 7 * (LOGIT_COPIES * 4 * rows + 2 * key_row)
    assert probe_tile(rows, key_row, small) == 7  # 200 keys in 29 tiles
    torch.testing.assert_close(scores(small), whole, atol=1e-6, rtol=1e-5)
    assert float(whole[151:198].sum()) > 0  # seen by the later queries only


def test_a_tile_is_one_key_at_least() -> None:
    assert probe_tile(1000, 1 << 20, 1) == 1
