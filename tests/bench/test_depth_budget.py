"""bench/depth_budget.py: gradual recomputation against the oracle's own paths (a constant
schedule is ``Oracle.recompute``; every token at every layer is full prefill), and what a
shrinking schedule computes and leaves reused."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from sgl_pic.layout import PromptLayout
from sgl_pic.oracle import Oracle
from sgl_pic.selection import Selection, finalize
from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def depth() -> ModuleType:
    return load_script("depth_budget")


def _prompt(oracle: Oracle) -> tuple[torch.Tensor, PromptLayout, object]:
    torch.manual_seed(5)
    ids = torch.randint(0, 97, (42,))
    layout = PromptLayout.from_lengths([10, 12, 14], fresh_tail=6)
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    return ids, layout, oracle.assemble(ids, layout, chunks)


def _chunk_rows(sel: Selection, layout: PromptLayout) -> int:
    idx = sel.indices
    return sum(int(((idx >= s.start) & (idx < s.end)).sum()) for s in layout.chunks)


@pytest.mark.parametrize("signal", ["deviation", "attention"])
def test_a_constant_schedule_is_the_oracles_recompute(
    depth: ModuleType, tiny_oracle: Oracle, signal: str
) -> None:
    ids, layout, assembled = _prompt(tiny_oracle)
    first = finalize(Selection(torch.tensor([3, 11, 12, 20, 30, 33])), layout)
    counts = [_chunk_rows(first, layout)] * tiny_oracle.w.num_layers
    got = depth.gradual_recompute(tiny_oracle, ids, layout, assembled, first, counts, signal)
    ref = tiny_oracle.recompute(ids, assembled, first)
    torch.testing.assert_close(got.logits, ref.logits)
    torch.testing.assert_close(got.kv.k, ref.kv.k)
    torch.testing.assert_close(got.kv.v, ref.kv.v)
    assert got.chunk_rows == counts


def test_every_token_at_every_layer_is_full_prefill(depth: ModuleType, tiny_oracle: Oracle) -> None:
    ids, layout, assembled = _prompt(tiny_oracle)
    every = Selection(torch.arange(ids.numel()))
    counts = [layout.num_reusable] * tiny_oracle.w.num_layers
    got = depth.gradual_recompute(tiny_oracle, ids, layout, assembled, every, counts, "attention")
    full = tiny_oracle.prefill(ids)
    torch.testing.assert_close(got.logits, full.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.kv.k, full.kv.k, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("signal", ["deviation", "attention"])
def test_a_shrinking_schedule_drops_rows_for_good(
    depth: ModuleType, tiny_oracle: Oracle, signal: str
) -> None:
    """Rows dropped at a layer keep the reused K/V at it and above; the fresh rows are
    computed at every layer; the counts are followed (by deviation, from layer 2)."""
    ids, layout, assembled = _prompt(tiny_oracle)
    n_layers = tiny_oracle.w.num_layers
    first = finalize(Selection(torch.arange(0, 36)), layout)  # every chunk row
    counts = [36 - 6 * li for li in range(n_layers)]
    got = depth.gradual_recompute(tiny_oracle, ids, layout, assembled, first, counts, signal)
    expect = [counts[0], counts[0], *counts[2:]] if signal == "deviation" else counts
    assert got.chunk_rows == expect[:n_layers]
    fresh = torch.tensor(layout.fresh_indices())
    changed = (got.kv.v - assembled.v).flatten(2).abs().amax(-1) > 0  # [L, N]
    assert changed[1:, fresh].all()
    # Rows 10-35: chunks after the first, whose recomputed K/V differ from their own
    # encoding's from layer 1 on (layer 0's V depend on the token alone).
    later = changed[:, 10:36]
    if signal == "deviation":  # nothing dropped before layer 2
        assert later[1].all()
    for li in range(2, n_layers):
        # Nested sets: a row not recomputed at layer li - 1 is not recomputed at li.
        assert not (later[li] & ~later[li - 1]).any()
        assert int(later[li].sum()) <= got.chunk_rows[li]
    assert int(later[-1].sum()) < int(later[1].sum())
    assert assembled.v.data_ptr() != got.kv.v.data_ptr()


def test_schedules_and_their_checks(depth: ModuleType, tiny_oracle: Oracle) -> None:
    s = depth.DepthSchedule(0.25, 0.05, "attention")
    counts = s.counts(100, 30)
    assert counts[0] == 100 and counts[-1] == 20
    assert sum(counts) / len(counts) == pytest.approx(60, abs=0.5)  # 15% of 400 at 25% first
    assert all(b <= a for a, b in zip(counts, counts[1:], strict=False))
    depth.check_schedule(s)
    for bad in (depth.DepthSchedule(0.1, 0.2, "attention"), depth.DepthSchedule(0.2, 0.1, "x")):
        with pytest.raises(ValueError):
            depth.check_schedule(bad)
    with pytest.raises(ValueError, match="non-increasing"):
        depth.gradual_recompute(tiny_oracle, torch.zeros(3), None, None, None, [1, 2], "x")
