from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pic.layout import LayoutError, PaddedPrompt, PromptLayout, Span, pad_chunk_starts


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


# Random prompts: alternating fresh gaps (possibly empty) and non-empty chunks; chunk tokens
# are >= 1000 and fresh tokens < 1000 so either kind can be picked out of a padded prompt.
@st.composite
def prompts(draw: st.DrawFn) -> tuple[list[int], PromptLayout]:
    parts = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 9)), min_size=0, max_size=6))
    tail = draw(st.integers(0 if parts else 1, 9))
    ids: list[int] = []
    spans: list[Span] = []
    for gap, length in parts:
        ids.extend(draw(st.lists(st.integers(1, 999), min_size=gap, max_size=gap)))
        start = len(ids)
        ids.extend(range(1000 + start, 1000 + start + length))
        spans.append(Span(start, len(ids)))
    ids.extend(draw(st.lists(st.integers(1, 999), min_size=tail, max_size=tail)))
    return ids, PromptLayout(len(ids), tuple(spans))


@settings(max_examples=200, deadline=None)
@given(prompt=prompts(), page_size=st.sampled_from([1, 2, 3, 4, 8, 16, 64]))
def test_padded_chunk_starts_are_page_aligned(
    prompt: tuple[list[int], PromptLayout], page_size: int
) -> None:
    ids, layout = prompt
    out = pad_chunk_starts(ids, layout, page_size, pad_id=0)
    assert len(out.token_ids) == out.layout.num_tokens
    assert len(out.layout.chunks) == len(layout.chunks)
    for old, new in zip(layout.chunks, out.layout.chunks, strict=True):
        assert new.start % page_size == 0
        assert out.token_ids[new.start : new.end] == ids[old.start : old.end]
    # Fresh tokens keep their order, with only pad tokens added among them.
    fresh = [out.token_ids[i] for i in out.layout.fresh_indices()]
    assert [t for t in fresh if t != 0] == [ids[i] for i in layout.fresh_indices()]
    # Each pad fills only the gap up to the next page boundary.
    assert fresh.count(0) == out.layout.num_tokens - layout.num_tokens
    assert fresh.count(0) <= len(layout.chunks) * (page_size - 1)


@settings(max_examples=100, deadline=None)
@given(prompt=prompts())
def test_page_size_one_is_the_identity(prompt: tuple[list[int], PromptLayout]) -> None:
    ids, layout = prompt
    out = pad_chunk_starts(ids, layout, 1, pad_id=0)
    assert out == PaddedPrompt(ids, layout)


def test_pads_go_right_before_each_chunk() -> None:
    # fresh [1], chunk [10, 11, 12], chunk [20], fresh [2, 3]; page size 4.
    layout = PromptLayout(7, (Span(1, 4), Span(4, 5)))
    out = pad_chunk_starts([1, 10, 11, 12, 20, 2, 3], layout, 4, pad_id=0)
    assert out.token_ids == [1, 0, 0, 0, 10, 11, 12, 0, 20, 2, 3]
    assert out.layout == PromptLayout(11, (Span(4, 7), Span(8, 9)))


def test_aligned_chunks_get_no_padding() -> None:
    ids = list(range(1, 13))
    layout = PromptLayout(12, (Span(0, 4), Span(4, 6), Span(8, 11)))
    assert pad_chunk_starts(ids, layout, 4, pad_id=0) == PaddedPrompt(ids, layout)


@pytest.mark.parametrize(
    ("page_size", "pad_id", "message"),
    [
        (0, 0, "page_size must be >= 1"),
        (-4, 0, "page_size must be >= 1"),
        (4, -1, "pad_id must be a token id >= 0"),
    ],
)
def test_bad_padding_arguments_raise(page_size: int, pad_id: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pad_chunk_starts([1, 2, 3], PromptLayout(3, (Span(1, 2),)), page_size, pad_id)


def test_token_count_must_match_layout() -> None:
    with pytest.raises(LayoutError, match="covers 3 tokens but the prompt has 2"):
        pad_chunk_starts([1, 2], PromptLayout(3, (Span(1, 2),)), 4, pad_id=0)
