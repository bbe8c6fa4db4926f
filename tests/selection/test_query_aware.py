"""query_aware: sinks first, then the question's attention; the score's definition."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.selection import SelectionContext, make_policy
from sgl_pic.selection.query_aware import query_positions, question_attention
from tests.selection.signals import LAYOUT
from tests.selection.signals import CountingSignal as Counting


def _select(
    signal: Counting | None,
    ratio: float = 0.2,
    sinks: int = 1,
    prefix_hit: int = 0,
    layout: PromptLayout = LAYOUT,
    min_tokens: int = 0,
) -> list[int]:
    config = PicConfig(
        policy="query_aware", qa_ratio=ratio, qa_sink_tokens=sinks, qa_min_tokens=min_tokens
    )
    policy = make_policy(config)
    ctx = SelectionContext(layout, prefix_hit=prefix_hit, query_attention=signal)
    return policy.select(ctx).indices.tolist()


def test_sinks_then_highest_attention_among_reused_tokens() -> None:
    values = torch.zeros(37)
    values[0:10] = 100.0  # first chunk: exact prefix KV, never a candidate
    values[20:25] = 50.0  # fresh: computed anyway, never a candidate
    values[[12, 30, 33, 15]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    signal = Counting(values)
    # 20 candidates: ceil(0.2 * 20) = 4 = sinks 10 and 25, then 12 and 30.
    assert _select(signal) == [10, 12, 25, 30]
    assert signal.calls == 1


def test_short_chunks_get_at_least_min_tokens_each() -> None:
    values = torch.arange(37, dtype=torch.float32)  # later tokens score higher
    # 2 candidate chunks x 3 = 6 > ceil(0.05 * 20) = 1: sinks 10 and 25, then 34, 33, 32, 31.
    assert _select(Counting(values), ratio=0.05, min_tokens=3) == [10, 25, 31, 32, 33, 34]
    # Never more than every candidate.
    assert len(_select(Counting(values), ratio=0.05, min_tokens=100)) == 20


def test_budget_smaller_than_the_sinks_keeps_the_earliest_and_skips_the_probe() -> None:
    signal = Counting(torch.ones(37))
    assert _select(signal, ratio=0.05, sinks=4) == [10]  # ceil(0.05 * 20) = 1
    assert signal.calls == 0


def test_device_prefix_is_never_selected() -> None:
    values = torch.zeros(37)
    values[12] = 9.0
    values[30] = 1.0
    # The second chunk is part device prefix: no sink there, and its prefix part (with the
    # highest score) is out. 15 candidates: ceil(0.2 * 15) = 3 = sink 25, 30, then the
    # lowest-index tie 15.
    assert _select(Counting(values), ratio=0.2, prefix_hit=15) == [15, 25, 30]


def test_missing_signal_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="query_attention"):
        _select(None)


def test_wrong_signal_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="shape"):
        _select(Counting(torch.ones(5)), ratio=0.5)


def test_full_ratio_is_exact_and_shares_the_exact_namespace() -> None:
    assert PicConfig(policy="query_aware", qa_ratio=1.0).exact
    assert not PicConfig(policy="query_aware").exact
    assert _select(Counting(torch.rand(37)), ratio=1.0) == list(range(10, 20)) + list(range(25, 35))


@pytest.mark.parametrize(
    ("field", "value"),
    [("qa_ratio", 0.0), ("qa_layers", 0), ("qa_layers", 17), ("qa_sink_tokens", -1)],
)
def test_settings_are_bounded(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PicConfig(policy="query_aware", **{field: value})


def test_query_positions_are_the_fresh_tail_or_the_last_token() -> None:
    assert query_positions(LAYOUT).tolist() == [35, 36]
    assert query_positions(LAYOUT, prefix_hit=36).tolist() == [36]
    ends_in_chunk = PromptLayout.from_spans(20, [[0, 10], [10, 20]])
    assert query_positions(ends_in_chunk).tolist() == [19]


def test_question_attention_is_causal_softmax_summed_over_heads_and_queries() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=g)  # 4 query heads over 2 KV heads
    k = torch.randn(10, 2, 8, generator=g)
    pos = torch.tensor([5, 8, 9])
    got = question_attention(q, k, pos)
    want = torch.zeros(10)
    for i, p in enumerate(pos.tolist()):
        for h in range(4):
            logits = k[: p + 1, h // 2] @ q[i, h] / math.sqrt(8)
            want[: p + 1] += torch.softmax(logits, dim=0)
    assert torch.allclose(got, want, atol=1e-5)
    assert float(got[6:].sum()) > 0 and float(got[9]) > 0
    assert math.isclose(float(got.sum()), 12.0, rel_tol=1e-5)
    # Queries in any order (the mask follows each query's own position), and none at all.
    assert torch.allclose(question_attention(q.flip(0), k, pos.flip(0)), want, atol=1e-5)
    assert float(question_attention(q[:0], k, pos[:0]).abs().sum()) == 0.0
    # A query never sees a later key.
    assert float(question_attention(q[:1], k, pos[:1])[6:].abs().sum()) == 0.0


def test_question_attention_takes_the_least_position_from_the_host() -> None:
    """A caller holding the positions on the device gives their least one (``first_pos``):
    the same scores, and ``q_pos`` is neither read nor copied to find it."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    pos = torch.tensor([8, 5, 9])
    want = question_attention(q, k, pos)

    class NoMin(torch.Tensor):
        """Positions whose least value must not be looked up."""

        def min(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("q_pos.min() read")

    got = question_attention(q, k, pos.as_subclass(NoMin), first_pos=5)
    assert torch.equal(got.as_subclass(torch.Tensor), want)
    with pytest.raises(AssertionError, match="read"):
        question_attention(q, k, pos.as_subclass(NoMin))


@pytest.mark.parametrize("tile", [1, 3, 7, 10, 64])
def test_tiled_question_attention_equals_one_softmax(tile: int) -> None:
    """Keys scored a tile at a time (two passes: each row's maximum and normaliser, then
    the weights) give one softmax's scores up to float rounding; with every key in one
    tile, the very same ones. Keys may be read on demand (``KeyRows``)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 8, generator=g) * 3
    k = torch.randn(10, 2, 8, generator=g)
    pos = torch.tensor([8, 2, 9])
    want = question_attention(q, k, pos)

    class Reads:
        """Keys handed out by slices only, counting the rows read."""

        shape, device, rows = k.shape, k.device, 0

        def __getitem__(self, rows: slice) -> torch.Tensor:
            out = k[rows]
            Reads.rows += out.shape[0]
            return out

    got = question_attention(q, Reads(), pos, tile=tile)
    if tile >= k.shape[0]:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert Reads.rows == 2 * k.shape[0]  # two passes, each key once per pass
    assert float(got[3:8].sum()) > 0 and math.isclose(float(got.sum()), 12.0, rel_tol=1e-5)
