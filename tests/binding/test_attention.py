"""How a phase batch's queries are cut into SDPA blocks (``attention.block_cuts``): every
query in exactly one block, no block past the cap, and the least work the cost model
allows: a spread selection is no longer attended to its last query's keys in one block."""

from __future__ import annotations

import itertools
import random

import torch

from sgl_pic.binding import attention
from sgl_pic.binding.attention import block_cuts, query_blocks


def work(last_seen: list[int], blocks: list[tuple[int, int]]) -> int:
    """Query-key pairs the blocks attend, plus each call's cost in pairs."""
    return sum(attention._BLOCK_CALL_PAIRS + (e - s) * last_seen[e - 1] for s, e in blocks)


def brute_force(last_seen: list[int]) -> int:
    """The least work over every choice of cuts at multiples of the minimum block."""
    n = len(last_seen)
    inner = list(range(attention._MIN_BLOCK, n, attention._MIN_BLOCK))
    best = None
    for k in range(len(inner) + 1):
        for chosen in itertools.combinations(inner, k):
            edges = [0, *chosen, n]
            blocks = list(itertools.pairwise(edges))
            if any(e - s > attention._QUERY_BLOCK for s, e in blocks):
                continue
            w = work(last_seen, blocks)
            best = w if best is None else min(best, w)
    assert best is not None
    return best


def check_cover(blocks: list[tuple[int, int]], n: int) -> None:
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    assert all(0 < e - s <= attention._QUERY_BLOCK for s, e in blocks)


def test_cuts_are_the_least_work_of_any_cuts() -> None:
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 120)
        num_keys = n + rng.randint(0, 3000)
        positions = sorted(rng.sample(range(num_keys), n))
        last_seen = [p + 1 for p in positions]
        blocks = block_cuts(last_seen)
        check_cover(blocks, n)
        assert work(last_seen, blocks) == brute_force(last_seen)


def test_a_spread_selection_is_cut_where_fixed_blocks_waste_keys() -> None:
    # 16 tokens recomputed in each of ten chunks of 100, then a question of 60 tokens:
    # one block of 128 queries would attend the eighth chunk's keys for all of them.
    positions = [c * 100 + 6 * i for c in range(10) for i in range(16)]
    positions += list(range(1000, 1060))
    last_seen = [p + 1 for p in positions]
    blocks = block_cuts(last_seen)
    check_cover(blocks, len(positions))
    fixed = [(s, min(s + 128, len(positions))) for s in range(0, len(positions), 128)]
    assert work(last_seen, blocks) < 0.9 * work(last_seen, fixed)
    assert len(blocks) > len(fixed)


def test_many_queries_stay_under_the_cap() -> None:
    positions = list(range(0, 4000, 2))  # 2000 queries, one every other key
    blocks = block_cuts([p + 1 for p in positions])
    check_cover(blocks, len(positions))


def test_query_blocks_mask_only_keys_past_each_query() -> None:
    q_index = torch.tensor([3, 4, 50, 51, 52, 300] + list(range(400, 440)))
    blocks = query_blocks(q_index, 500)
    assert blocks[0].start == 0 and blocks[-1].end == q_index.numel()
    for b in blocks:
        qi = q_index[b.start : b.end]
        assert b.keys == int(qi[-1]) + 1
        assert b.mask is not None
        assert torch.equal(b.mask, torch.arange(b.keys)[None, :] <= qi[:, None])


def test_a_whole_prompt_is_one_causal_block() -> None:
    assert query_blocks(torch.arange(70), 70) == (attention.QueryBlock(0, 70, 70, None),)
