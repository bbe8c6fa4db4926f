"""Phase 1's store step (``Phase1._store`` through ``chunk_store``): piece by piece, it
writes what one read of the whole miss wrote, bit for bit, into the chunk nodes, the
host tier's records and the request's slots, and ranks as ``cachetune_ranking`` of the
whole miss does, up to float rounding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import EncodingContext
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.chunk_store import Destination, rank_miss, store_miss
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.phase1 import Encoding, NodeWriter, Phase1
from sgl_pic.engine.rotation import ModelRope, RopeSpec
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import RopeLayout, default_inv_freq
from sgl_pic.selection import cachetune_ranking
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.support.fakes import FakeAllocator, FakePool

LAYERS, HEADS, DIM, SEGMENT = 3, 2, 16, 8
INV_FREQ = default_inv_freq(DIM, 10000.0)
CONTEXT = "c" * 64  # the digest of an encoding context, as ``gate`` names one
ALPHA = PicConfig().cachetune_alpha


class Miss(NamedTuple):
    """One encoded miss of a request, ready for ``Phase1._store``, and where to look."""

    phase1: Phase1
    plan: Any
    enc: Encoding
    pool: FakePool
    lower: LowerTiers | None
    nodes: ChunkNodeTable
    request: torch.Tensor  # [num_tokens] the request's slots


def make_miss(
    tmp: Path,
    n: int,
    *,
    at: int = 0,
    prefix: int = 0,
    dtype: torch.dtype = torch.float32,
    staging_bytes: int = 1 << 12,
    lower: bool = True,
    rope: ModelRope | None = None,
    layers: int = LAYERS,
    heads: int = HEADS,
    dim: int = DIM,
    segment: int = SEGMENT,
    seed: int = 0,
) -> Miss:
    """A request [context][miss of n tokens][2 question tokens], the miss's KV random in
    the pool where phase 1 encoded it (keys at positions at..at+n-1): the request's own
    slots, or slots taken for it when the device prefix (``prefix``) cuts it."""
    g = torch.Generator().manual_seed(seed)
    size = at + 3 * n + 64
    pool = FakePool(size + 1, layers, heads, dim, dtype=dtype)
    alloc = FakeAllocator(size)
    request = alloc.alloc(at + n + 2)
    assert request is not None
    own = request[at : at + n] if prefix <= at else alloc.alloc(n)
    assert own is not None
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf[own] = torch.randn(n, heads, dim, generator=g).to(dtype)
    fp = ModelFingerprint(model_id="test-model", dtype=str(dtype).removeprefix("torch."))
    nodes = ChunkNodeTable(alloc, fp, segment, 2 * n)
    inv_freq = default_inv_freq(dim, 10000.0)
    rope = rope if rope is not None else ModelRope.plain(inv_freq, max_positions=size)
    kv = KVAccess(pool, layers, rope, staging_bytes=staging_bytes)
    tiers = None
    if lower:
        cfg = TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=1 << 30, pin_memory=False),
            disk=DiskStoreConfig(root=str(tmp / "disk"), capacity_bytes=1 << 30),
        )
        pre = ModelFingerprint(model_id="test-model", dtype=fp.dtype, pre_rope=True)
        tiers = LowerTiers(TieredStore(cfg, pre.digest()), pre, segment, inv_freq)
    forwards = SimpleNamespace(
        kv=kv, lower=tiers, reduce=None, slots=lambda plan, a, b: request[a:b]
    )
    writer = NodeWriter(nodes, kv, lambda: None)
    phase1 = Phase1(PicConfig(), forwards, writer)  # type: ignore[arg-type]
    tokens = tuple(torch.randint(1, 30000, (at + n + 2,), generator=g).tolist())
    context = EncodingContext(at, CONTEXT, ()) if at else EncodingContext()
    pending = SimpleNamespace(token_ids=tokens, namespace="", context_for=lambda s: context)
    plan = SimpleNamespace(pending=pending, prefix=prefix)
    context_slots = request[:at] if at else torch.empty(0, dtype=torch.int64)
    return Miss(phase1, plan, Encoding(own, context_slots, False), pool, tiers, nodes, request)


class OneShot(NamedTuple):
    """What a read of the whole miss gives (the store's reference): its KV with keys at
    0..n-1 # [L, 2, n, H, D], its pre-RoPE keys # [L, n, H, D], its ranking # [n], and
    the request's KV afterwards, keys at the chunk's position # [L, 2, n, H, D]."""

    kv: torch.Tensor
    k_pre: torch.Tensor
    ranking: torch.Tensor
    request: torch.Tensor


def one_shot(miss: Miss, start: int) -> OneShot:
    kv_access = miss.phase1.forwards.kv
    kv = kv_access.read(miss.enc.slots, miss.enc.context.numel())
    k_pre = kv_access.pre_rope_keys(kv)
    ranking = cachetune_ranking(k_pre, kv[:, 1], ALPHA)
    moved = kv.clone()
    kv_access.rotate_in_place(moved[:, 0], start)
    return OneShot(kv, k_pre, ranking, moved)


def pool_rows(pool: FakePool, slots: torch.Tensor) -> torch.Tensor:
    """# [L, 2, m, H, D] the pool's K and V at ``slots``."""
    return torch.stack(
        [
            torch.stack([k[slots], v[slots]])
            for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True)
        ]
    )


@pytest.fixture
def closing() -> Iterator[list[LowerTiers]]:
    made: list[LowerTiers] = []
    yield made
    for lower in made:
        lower.store.close()


def table_rope(size: int, layout: RopeLayout) -> ModelRope:
    """A rope read through its table only (no plain frequencies): whole-head rotations."""
    plain = ModelRope.plain(INV_FREQ, max_positions=size, layout=layout).spec
    return ModelRope(RopeSpec(plain.cos_sin, DIM, DIM, layout, 1.0, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("at", "prefix"), [(0, 0), (5, 0), (0, 9), (4, 13)])
@pytest.mark.parametrize(
    ("staging_bytes", "rope"),
    [(1 << 30, "plain"), (1 << 12, "plain"), (1 << 12, "interleaved"), (1 << 12, "table")],
    ids=["one_piece", "pieces", "pieces_interleaved", "pieces_table"],
)
def test_the_store_writes_what_one_read_of_the_whole_miss_wrote(
    tmp_path: Path,
    closing: list[LowerTiers],
    dtype: torch.dtype,
    at: int,
    prefix: int,
    staging_bytes: int,
    rope: str,
) -> None:
    n = 45  # segments of 8: the last one short
    size = at + 3 * n + 64
    model_rope = (
        table_rope(size, "neox")
        if rope == "table"
        else ModelRope.plain(INV_FREQ, size, "interleaved" if rope == "interleaved" else "neox")
    )
    miss = make_miss(
        tmp_path,
        n,
        at=at,
        prefix=prefix,
        dtype=dtype,
        staging_bytes=staging_bytes,
        rope=model_rope,
    )
    assert miss.lower is not None
    closing.append(miss.lower)
    start = at
    want = one_shot(miss, start)
    ranking = miss.phase1._store(miss.plan, start, start + n, miss.enc)

    torch.testing.assert_close(ranking, want.ranking, atol=2e-5, rtol=1e-5)
    tokens = miss.plan.pending.token_ids[start : start + n]
    context = CONTEXT if at else ""
    hit = miss.nodes.match(tokens, "", context)
    assert hit is not None and len(hit.nodes) == -(-n // SEGMENT)
    assert torch.equal(pool_rows(miss.pool, hit.slots), want.kv)
    keep = max(start, prefix)
    past = miss.request[keep : start + n]
    assert torch.equal(pool_rows(miss.pool, past), want.request[:, :, keep - start :])
    for key in miss.lower.keys(tokens, "", context):
        record = miss.lower.store.get(key.digest, tokens[key.start : key.end])
        assert record is not None
        assert torch.equal(record.k, want.k_pre[:, key.start : key.end])
        assert torch.equal(record.v, want.kv[:, 1, key.start : key.end])
        assert torch.equal(record.ranking, ranking[key.start : key.end])


def test_pieces_stay_within_the_staging_bound_and_cover_each_row_once(tmp_path: Path) -> None:
    """Without records, the copies run in pieces of one layer's rows once a layer does not
    fit; the request gets every row once (a row written twice would be rotated twice)."""
    n = 100
    miss = make_miss(tmp_path, n, at=3, lower=False, staging_bytes=1 << 13)
    kv = miss.phase1.forwards.kv
    want = one_shot(miss, 3)
    staged: list[int] = []
    gather = kv.gather

    def counted(rows: torch.Tensor, layer: int, layer_end: int) -> torch.Tensor:
        out = gather(rows, layer, layer_end)
        staged.append(out.numel() * out.element_size())
        return out

    kv.gather = counted  # type: ignore[method-assign]
    rows = kv.checked(miss.enc.slots)
    store_miss(kv, rows, 3, [], Destination(rows, 0), 3, None)
    assert len(staged) > LAYERS  # the rows of a layer came in several pieces
    assert max(staged) <= kv.staging_bytes
    assert torch.equal(pool_rows(miss.pool, miss.enc.slots), want.request)


def test_the_pool_ranking_is_the_whole_miss_ranking_past_the_projection_with_a_reduce(
    tmp_path: Path,
) -> None:
    """A miss long enough for the FFT filter, ranked in slabs of rotary pairs, with a
    tensor-parallel reduce (here: the other rank holds the same heads): the ranking of
    the whole miss's pre-RoPE keys and values with that reduce."""
    n, at = 600, 7
    miss = make_miss(tmp_path, n, at=at, lower=False, staging_bytes=1 << 14)
    kv = miss.phase1.forwards.kv
    want = one_shot(miss, at)
    sent: list[torch.Tensor] = []

    def twice(t: torch.Tensor) -> torch.Tensor:
        sent.append(t)
        return 2 * t

    got = rank_miss(kv, kv.checked(miss.enc.slots), at, 0.3, twice)
    assert len(sent) == 2 and sent[0].shape == (LAYERS, n)  # K's squares, then V's
    expected = cachetune_ranking(want.k_pre, want.kv[:, 1], 0.3, reduce=lambda t: 2 * t)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
