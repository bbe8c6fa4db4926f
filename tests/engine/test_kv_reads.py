"""The KV-read model of the paged backends' plans (``engine.kv_reads``), by brute force."""

from __future__ import annotations

import math

import pytest

from sgl_pic.engine.kv_reads import (
    AttnShape,
    ReadCap,
    SubRequest,
    TilePlan,
    exact_reads,
    fa3_rows,
    flashinfer_rows,
    flashinfer_tile,
    planned_reads,
    read_cap,
    reference_reads,
    tile_reads,
)


def brute_reads(sub: SubRequest, tile: TilePlan) -> int:
    """Each packed row (token t, head h) sees keys 0..prefix+t; a tile loads, in blocks,
    up to what its last-seeing row sees, never past the sub-request's KV."""
    rows = [(t, h) for t in range(sub.extend) for h in range(tile.group)]
    kv_len = sub.prefix + sub.extend
    total = 0
    for m in range(0, len(rows), tile.rows):
        seen = max(sub.prefix + t + 1 for t, _ in rows[m : m + tile.rows])
        total += min(kv_len, math.ceil(seen / tile.block_kv) * tile.block_kv)
    return total


@pytest.mark.parametrize("tile", [TilePlan(16, 1), TilePlan(64, 4), TilePlan(128, 7, 128)])
@pytest.mark.parametrize("sub", [SubRequest(0, 1), SubRequest(0, 300), SubRequest(517, 45)])
def test_tile_reads_are_the_causal_tiles_reads(sub: SubRequest, tile: TilePlan) -> None:
    assert tile_reads(sub, tile) == brute_reads(sub, tile)


@pytest.mark.parametrize("tokens", [1, 7, 32, 33, 1000])
@pytest.mark.parametrize("prefix", [0, 5, 4096])
def test_reference_reads_closed_form(prefix: int, tokens: int) -> None:
    # Whole tokens per tile: rows = tokens * group, the group divides the rows.
    for tile in (1, 8, 32):
        assert reference_reads(prefix, tokens, tile) == tile_reads(
            SubRequest(prefix, tokens), TilePlan(tile * 4, 4)
        )
    assert reference_reads(prefix, 0, 8) == 0


def test_tiles_each_backend_picks() -> None:
    # FlashInfer: the batch's average packed query rows (integer division) picks it.
    assert [flashinfer_rows(a, 128) for a in (1, 16, 17, 64, 65)] == [16, 16, 64, 64, 128]
    assert flashinfer_rows(1000, 256) == 64
    shape = AttnShape(4, 128)
    # (5 + 1 + 10) tokens x 4 heads over 3 sub-requests: 21 rows on average.
    subs = [SubRequest(0, 5), SubRequest(9, 1), SubRequest(20, 10)]
    assert flashinfer_tile(subs, shape) == TilePlan(64, 4)
    assert flashinfer_tile(subs[:1], shape).rows == 64
    assert flashinfer_tile([SubRequest(0, 17)], shape).rows == 128
    assert (fa3_rows(64), fa3_rows(128), fa3_rows(256)) == (192, 128, 128)
    with pytest.raises(ValueError, match="no read model"):
        planned_reads("triton", subs, shape)


def test_many_short_runs_read_their_prefix_each_exact_prefill_once_per_tile() -> None:
    # 64 one-token runs spread over 8192 tokens, on FA3 (128 rows, group 4: 32 tokens a
    # tile) read about 64 x 4096 keys; exact prefill reads 256 tiles of 16 keys' average.
    shape = AttnShape(4, 128)
    n = 8192
    runs = [SubRequest(p, 1) for p in range(64, n, 128)]
    exact = exact_reads("fa3", n, shape)
    assert exact == tile_reads(SubRequest(0, n), TilePlan(128, 4, 128))
    ratio = planned_reads("fa3", runs, shape) / exact
    # Sum of the runs' block-rounded prefixes over n^2 / 64 (+ block rounding).
    assert 0.2 < ratio < 0.3
    dense = [SubRequest(p, 1) for p in range(64, n, 8)]
    assert planned_reads("fa3", dense, shape) / exact > 3


def test_read_cap() -> None:
    assert read_cap(4, 128, 0) is None
    cap = read_cap(4, 128, 1.25)
    assert cap == ReadCap(4, 128, 1.25)
    # FA3's tile, then FlashInfer's 16-, 64- and 128-row tiles, in tokens.
    assert cap.tiles == (32, 4, 16, 32)
    assert read_cap(3, 64, 2.0).tiles == (64, 5, 21, 42)  # type: ignore[union-attr]
    assert read_cap(16, 128, 1.0).tiles == (8, 1, 4, 8)  # type: ignore[union-attr]
    # Exact prefill of 1000 tokens: FlashInfer's 128-row tile (4000 packed rows).
    fa3_limit, fi_limit = cap.limits(0, 1000)
    assert fa3_limit == fi_limit == 1.25 * reference_reads(0, 1000, 32)
    # Ten one-token runs: 4 packed rows on average, FlashInfer picks 16 rows (4 tokens);
    # ten of 20 tokens: 80 rows, 128 (32 tokens).
    assert cap.flashinfer_index(10, 10) == 1 and cap.flashinfer_index(200, 10) == 3
    runs = [cap.reads(p, 1) for p in range(0, 1000, 100)]
    reads = [sum(col) for col in zip(*runs, strict=True)]
    assert cap.holds(reads, 10, 10, (fa3_limit, fi_limit))
    assert not cap.holds(reads, 10, 10, (fa3_limit, reads[1] - 1))
    assert not cap.holds(reads, 10, 10, (reads[0] - 1, fi_limit))
