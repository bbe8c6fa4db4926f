import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pic.config import MTAF_NAMES, PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.selection import (
    SelectionContext,
    daric_budget,
    daric_select,
    make_policy,
    mtaf_values,
)

MTAFS = st.sampled_from(MTAF_NAMES)
# PicConfig refuses n_avg = 0 (that is full_reuse); daric_budget itself takes it.
N_AVG = st.floats(min_value=0.0, max_value=512.0, allow_nan=False, exclude_min=True)
RATIO = st.floats(min_value=1e-3, max_value=1.0)


def _close(x: float, y: float, scale: float) -> bool:
    return abs(x - y) <= 1e-9 * max(1.0, scale)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(3, 120), n_avg=N_AVG, r=RATIO, mtaf=MTAFS)
def test_solution_satisfies_the_three_equations_of_eq4(
    m: int, n_avg: float, r: float, mtaf: str
) -> None:
    bud = daric_budget(m, n_avg, r, mtaf)
    f = mtaf_values(mtaf, m)
    a, b, n_l = bud.a, bud.b, bud.n_latest
    scale = m * n_avg + abs(a) * sum(abs(x) for x in f) + abs(b) * m
    assert _close(a * f[m - 1] + b - n_l, 0.0, scale)
    assert _close(a * f[1] + b, r * n_avg, scale)
    assert _close(a * math.fsum(f[1:]) + (m - 1) * b + n_l, m * n_avg, scale)
    # and the per-chunk budgets are the line a f(i) + b itself
    for i, n_i in enumerate(bud.per_chunk, start=2):
        assert _close(n_i, a * f[i - 1] + b, scale)


@pytest.mark.parametrize("mtaf", MTAF_NAMES)
@pytest.mark.parametrize("m", [3, 4, 7, 20])
def test_closed_form_matches_a_generic_linear_solve(mtaf: str, m: int) -> None:
    f = {"linear": float, "log": math.log, "exp": math.exp}[mtaf]  # unscaled f
    n_avg, r = 24.0, 0.3
    a_mat = torch.tensor(
        [
            [f(m), 1.0, -1.0],
            [f(2), 1.0, 0.0],
            [math.fsum(f(i) for i in range(2, m + 1)), m - 1.0, 1.0],
        ],
        dtype=torch.float64,
    )
    c = torch.tensor([0.0, r * n_avg, m * n_avg], dtype=torch.float64)
    a, b, n_l = torch.linalg.solve(a_mat, c).tolist()
    bud = daric_budget(m, n_avg, r, mtaf)
    # exp is solved for e^(x - M): the same line with a scaled by e^M
    a_ref = a * math.exp(m) if mtaf == "exp" else a
    assert bud.a == pytest.approx(a_ref, rel=1e-9)
    assert bud.b == pytest.approx(b, rel=1e-9, abs=1e-9)
    assert bud.n_latest == pytest.approx(n_l, rel=1e-9)


def test_exp_mtaf_does_not_overflow_for_many_chunks() -> None:
    bud = daric_budget(5000, 32.0, 0.1, "exp")
    assert all(math.isfinite(x) for x in (bud.a, bud.b, bud.n_latest, *bud.per_chunk))
    assert math.fsum(bud.per_chunk) + bud.n_latest == pytest.approx(5000 * 32.0, rel=1e-9)
    assert sum(bud.per_chunk_tokens) + bud.latest_tokens <= bud.total_tokens


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 200), n_avg=N_AVG, r=RATIO, mtaf=MTAFS)
def test_budget_never_exceeds_m_n_avg(m: int, n_avg: float, r: float, mtaf: str) -> None:
    bud = daric_budget(m, n_avg, r, mtaf)
    assert bud.total_tokens == math.floor(m * n_avg + 1e-9 * max(1.0, m * n_avg))
    assert sum(bud.per_chunk_tokens) + bud.latest_tokens <= bud.total_tokens
    assert len(bud.per_chunk) == len(bud.per_chunk_tokens) == max(0, m - 1)
    assert all(n >= 0 for n in (*bud.per_chunk, *bud.per_chunk_tokens, bud.latest_tokens))


@settings(max_examples=100, deadline=None)
@given(
    m=st.integers(1, 60),
    extra=st.integers(1, 60),
    n_avg=N_AVG,
    r=RATIO,
    mtaf=MTAFS,
)
def test_proposition_1_budgets_never_grow_with_more_chunks(
    m: int, extra: int, n_avg: float, r: float, mtaf: str
) -> None:
    small, large = daric_budget(m, n_avg, r, mtaf), daric_budget(m + extra, n_avg, r, mtaf)
    for i in range(m - 1):  # n_2..n_M of the smaller prompt
        assert small.per_chunk[i] >= large.per_chunk[i] - 1e-9 * max(1.0, n_avg)
        assert small.per_chunk_tokens[i] >= large.per_chunk_tokens[i]


@pytest.mark.parametrize("mtaf", MTAF_NAMES)
def test_budgets_grow_with_the_chunk_index(mtaf: str) -> None:
    bud = daric_budget(12, 32.0, 0.1, mtaf)
    assert list(bud.per_chunk) == sorted(bud.per_chunk)
    assert bud.per_chunk[0] == pytest.approx(0.1 * 32.0)
    assert bud.per_chunk[-1] == bud.n_latest


def test_one_segment_selects_nothing() -> None:
    bud = daric_budget(1, 32.0, 0.1, "linear")
    assert (bud.a, bud.b, bud.n_latest, bud.per_chunk, bud.latest_tokens) == (0, 0, 0, (), 0)
    layout = PromptLayout.from_lengths([50])
    assert daric_select(layout, PicConfig(daric_n_avg=32.0)).indices.tolist() == []


def test_two_segments_keep_n2_and_the_total() -> None:
    bud = daric_budget(2, 10.0, 0.2, "log")
    assert bud.per_chunk == (pytest.approx(2.0),)
    assert bud.n_latest == pytest.approx(18.0)
    assert (bud.per_chunk_tokens, bud.latest_tokens, bud.total_tokens) == ((2,), 18, 20)


def test_zero_n_avg_is_refused_as_a_config() -> None:
    # A zero budget selects nothing, which is full_reuse: it must be asked for by name.
    with pytest.raises(ValueError, match="daric_n_avg"):
        PicConfig(daric_n_avg=0.0)
    assert daric_budget(3, 0.0, 0.1, "linear").total_tokens == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 8.0, 0.1, "linear"), "num_chunks"),
        ((3, -1.0, 0.1, "linear"), "n_avg"),
        ((3, 8.0, 0.0, "linear"), "r must"),
        ((3, 8.0, 0.1, "cubic"), "unknown MTAF"),
    ],
)
def test_budget_rejects_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        daric_budget(*args)


def _sel(layout: PromptLayout, **overrides: object) -> list[int]:
    settings_ = {"daric_mtaf": "linear", "daric_max_iters": 3, **overrides}
    return daric_select(layout, PicConfig(**settings_)).indices.tolist()


def test_algorithm1_initial_tokens_and_latest_window_without_compensation() -> None:
    # M = 3, n_avg = 4, r = 0.5: a = 3, n_2 = 2, n_3 = n_l = 5; 2 + 5 + 5 = 12 = M n_avg.
    layout = PromptLayout.from_lengths([20, 20, 20])
    expected = [20, 21, *range(40, 45), *range(55, 60)]
    assert _sel(layout, daric_n_avg=4.0, daric_r=0.5) == expected


def test_algorithm1_compensates_an_overlap_before_the_last_interval() -> None:
    # n_3 = 5 covers 40..44 and the latest window 41..45: merged 40..45 loses 4 tokens,
    # which are prepended before 40.
    layout = PromptLayout.from_lengths([20, 20, 6])
    expected = [20, 21, *range(36, 46)]
    assert _sel(layout, daric_n_avg=4.0, daric_r=0.5) == expected


def test_algorithm1_compensation_rounds_merge_into_earlier_intervals() -> None:
    # M = 4, n_avg = 3, r = 0.5: n = 1, 2, 3 and n_l = 3, cap 12.
    # Initial {10, 14, 15, 19, 20, 21}; round 1 prepends 13..18 (two already chosen) ->
    # {10, 13..21}; round 2 prepends the 2 still missing before 13 -> 10..21.
    layout = PromptLayout.from_lengths([10, 4, 5, 3])
    kw = {"daric_n_avg": 3.0, "daric_r": 0.5}
    assert _sel(layout, daric_max_iters=0, **kw) == [10, 14, 15, 19, 20, 21]
    assert _sel(layout, daric_max_iters=1, **kw) == [10, *range(13, 22)]
    assert _sel(layout, daric_max_iters=3, **kw) == list(range(10, 22))


def test_algorithm1_never_reaches_into_the_first_segment() -> None:
    # Budget 12 but only the 7 tokens after the first segment exist.
    layout = PromptLayout.from_lengths([10, 4, 3])
    assert _sel(layout, daric_n_avg=4.0, daric_r=0.5) == list(range(10, 17))


def test_compensation_of_an_empty_set_grows_the_latest_window() -> None:
    # M = 2, n_avg = 0.5: n_2 = floor(0.05) = 0, n_l = floor(0.95) = 0, cap = 1.
    layout = PromptLayout.from_lengths([5, 5])
    assert _sel(layout, daric_n_avg=0.5, daric_r=0.1) == [9]


def test_fresh_segments_count_as_segments() -> None:
    # [chunk 0-8][fresh 8-10][chunk 10-20]: M = 3, like three chunks. Initial
    # {8} | {10, 11} | {18, 19} is one short of the cap 6: 17 is prepended.
    layout = PromptLayout.from_spans(20, [[0, 8], [10, 20]])
    bud = daric_budget(3, 2.0, 0.5, "linear")
    assert (bud.per_chunk_tokens, bud.latest_tokens) == ((1, 2), 2)
    assert _sel(layout, daric_n_avg=2.0, daric_r=0.5) == [8, 10, 11, 17, 18, 19]


def test_policy_is_daric_select() -> None:
    layout = PromptLayout.from_spans(60, [[0, 10], [12, 30], [30, 55]])
    config = PicConfig(policy="daric", daric_n_avg=6.0, daric_mtaf="log")
    got = make_policy(config).select(SelectionContext(layout)).indices
    assert torch.equal(got, daric_select(layout, config).indices)


@st.composite
def layouts(draw: st.DrawFn) -> PromptLayout:
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=12))
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(lengths), max_size=len(lengths)))
    spans, pos = [], 0
    for length, gap in zip(lengths, gaps, strict=True):
        pos += gap
        spans.append([pos, pos + length])
        pos += length
    return PromptLayout.from_spans(pos + draw(st.integers(0, 5)), spans)


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), n_avg=N_AVG, r=RATIO, mtaf=MTAFS, iters=st.integers(0, 5))
def test_selection_is_bounded_unique_and_skips_the_first_segment(
    layout: PromptLayout, n_avg: float, r: float, mtaf: str, iters: int
) -> None:
    config = PicConfig(daric_n_avg=n_avg, daric_r=r, daric_mtaf=mtaf, daric_max_iters=iters)
    idx = daric_select(layout, config).indices
    segments = layout.segments()
    assert idx.numel() <= math.floor(len(segments) * n_avg + 1e-6)
    assert torch.equal(idx, torch.unique(idx))
    if idx.numel():
        assert idx.min() >= segments[0].span.end
        assert idx.max() < layout.num_tokens
