from __future__ import annotations

import pytest

from sgl_pic.layout import LayoutError, PromptLayout, Span


def test_segments_cover_prompt_in_order() -> None:
    layout = PromptLayout(20, (Span(2, 8), Span(8, 12), Span(15, 18)))
    segs = layout.segments()
    assert [(s.span.start, s.span.end, s.reusable) for s in segs] == [
        (0, 2, False),
        (2, 8, True),
        (8, 12, True),
        (12, 15, False),
        (15, 18, True),
        (18, 20, False),
    ]
    assert layout.fresh_indices() == [0, 1, 12, 13, 14, 18, 19]
    assert layout.num_reusable == 13


@pytest.mark.parametrize(
    "spans, message",
    [
        ([[0, 5], [4, 8]], "overlaps"),
        ([[5, 8], [0, 3]], "overlaps or precedes"),
        ([[0, 11]], "out of range"),
        ([[-1, 3]], "out of range"),
        ([[3, 3]], "empty"),
        ([[0]], "pair of integers"),
        ([[0, "a"]], "pair of integers"),
    ],
)
def test_malformed_spans_rejected(spans: list, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        PromptLayout.from_spans(10, spans)


def test_empty_prompt_rejected() -> None:
    with pytest.raises(LayoutError):
        PromptLayout(0, ())
