"""The chunk KV store and KV re-rotation against the RoPE reference (no SGLang needed)."""

from __future__ import annotations

import torch

from sgl_pic.integration.chunk_store import ChunkKVStore
from sgl_pic.integration.kv_access import KVAccess
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import apply_rope, default_inv_freq

FP = ModelFingerprint(model_id="m", dtype="float32")


def kv(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 3, 8, generator=g)  # [layers, K/V, n, heads, dim]


def test_hit_needs_every_segment_and_returns_the_stored_kv() -> None:
    store = ChunkKVStore(FP, segment_tokens=4, budget_bytes=1 << 20)
    toks = list(range(10))
    x = kv(10)
    assert store.get(toks) is None
    store.put(toks, x, torch.arange(10.0))
    hit = store.get(toks)
    assert hit is not None
    assert torch.equal(hit.kv, x) and torch.equal(hit.ranking, torch.arange(10.0))
    assert store.get(toks[:9]) is None  # another chunk: another last segment
    assert store.get([99] + toks[1:]) is None  # segments chain: a changed first token misses


def test_lru_eviction_keeps_budget() -> None:
    one = kv(4).numel() * 4
    store = ChunkKVStore(FP, segment_tokens=4, budget_bytes=2 * one)
    for i in range(3):
        store.put([i] * 4, kv(4, i))
    assert store.bytes_used <= 2 * one
    assert store.get([0] * 4) is None and store.get([2] * 4) is not None


class FakePool:
    def __init__(self, layers: int, slots: int) -> None:
        self.k = [torch.zeros(slots, 3, 8) for _ in range(layers)]
        self.v = [torch.zeros(slots, 3, 8) for _ in range(layers)]

    def get_key_buffer(self, i: int) -> torch.Tensor:
        return self.k[i]

    def get_value_buffer(self, i: int) -> torch.Tensor:
        return self.v[i]


def test_write_rotated_moves_keys_to_their_new_positions() -> None:
    inv = default_inv_freq(8, 10000.0)
    pre = torch.randn(2, 5, 3, 8)  # pre-RoPE keys per layer
    at0 = torch.stack([apply_rope(pre[i], torch.arange(5), inv) for i in range(2)])
    at7 = torch.stack([apply_rope(pre[i], torch.arange(7, 12), inv) for i in range(2)])
    vals = torch.randn(2, 5, 3, 8)
    pool = FakePool(2, 20)
    access = KVAccess(pool, 2, inv)
    slots = torch.tensor([3, 9, 4, 15, 0])
    access.write_rotated(slots, torch.stack([at0, vals], dim=1), start=7)
    back = access.read(slots)
    torch.testing.assert_close(back[:, 0], at7, atol=1e-5, rtol=1e-5)
    assert torch.equal(back[:, 1], vals)
