import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.selection import SelectionContext, make_policy
from tests.selection.signals import LAYOUT
from tests.selection.signals import CountingSignal as CountingDeviation


def _select(
    deviation: CountingDeviation | None,
    layout: PromptLayout = LAYOUT,
    ratio: float = 0.15,
    prefix_hit: int = 0,
) -> list[int]:
    policy = make_policy(PicConfig(policy="cacheblend", cacheblend_ratio=ratio))
    ctx = SelectionContext(layout, deviation=deviation, prefix_hit=prefix_hit)
    return policy.select(ctx).indices.tolist()


def test_top_ratio_of_reused_tokens_outside_the_first_chunk() -> None:
    values = torch.zeros(37)
    values[0:10] = 100.0  # first chunk: exact prefix KV, never a candidate
    values[20:25] = 50.0  # fresh: computed anyway, never a candidate
    values[[12, 30, 33, 15]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    # 20 candidates (10-20, 25-35): ceil(0.15 * 20) = 3
    assert _select(CountingDeviation(values)) == [12, 30, 33]


def test_deviation_is_computed_once() -> None:
    dev = CountingDeviation(torch.rand(37))
    _select(dev)
    assert dev.calls == 1


def test_leading_chunk_after_fresh_text_is_a_candidate() -> None:
    layout = PromptLayout.from_spans(20, [[2, 10], [10, 20]])
    values = torch.zeros(20)
    values[[3, 15]] = torch.tensor([9.0, 1.0])
    # 18 candidates: ceil(0.15 * 18) = 3; 3 and 15, then the lowest zero-deviation index
    assert _select(CountingDeviation(values), layout) == [2, 3, 15]


def test_device_prefix_is_not_a_candidate() -> None:
    values = torch.zeros(37)
    values[[11, 12, 30]] = torch.tensor([9.0, 8.0, 1.0])
    # candidates 15-20 and 25-35: 15 tokens, ceil(0.15 * 15) = 3
    assert _select(CountingDeviation(values), prefix_hit=15) == [15, 16, 30]


def test_ties_go_to_the_lower_index() -> None:
    assert _select(CountingDeviation(torch.ones(37)), ratio=0.1) == [10, 11]


def test_only_a_first_chunk_selects_nothing_without_computing_deviation() -> None:
    dev = CountingDeviation(torch.rand(12))
    assert _select(dev, PromptLayout.from_spans(12, [[0, 10]])) == []
    assert dev.calls == 0


def test_missing_deviation_raises() -> None:
    with pytest.raises(ValueError, match="cacheblend needs ctx.deviation"):
        _select(None)


def test_wrong_deviation_shape_raises() -> None:
    with pytest.raises(ValueError, match="deviation must have shape \\(37,\\)"):
        _select(CountingDeviation(torch.rand(36)))
