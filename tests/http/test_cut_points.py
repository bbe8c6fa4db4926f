"""Content-defined cut points: bounded windows, the same cuts for the same tokens, and
windows that survive an edit."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from sgl_pic.http.cut_points import WINDOW, cut_points


def _windows(ids: list[int], size: int, min_tokens: int = 4) -> list[tuple[int, ...]]:
    cuts = cut_points(ids, size, min_tokens)
    return [tuple(ids[a:b]) for a, b in pairwise([0, *cuts])]


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def test_a_text_within_the_size_is_one_window() -> None:
    assert cut_points(list(range(256)), 256, 4) == [256]
    assert cut_points([7], 256, 4) == [1]


@pytest.mark.parametrize("size", [32, 64, 256])
def test_windows_are_bounded_and_cover_the_text(size: int) -> None:
    ids = _tokens(5000, size)
    cuts = cut_points(ids, size, 4)
    lengths = [b - a for a, b in pairwise([0, *cuts])]
    assert cuts[-1] == len(ids) and cuts == sorted(set(cuts))
    assert all(n <= size for n in lengths[:-1]) and lengths[-1] < size + 4
    assert all(n >= max(size // 4, 4) for n in lengths[:-1]) and lengths[-1] >= 4
    # Cut by content, not forced by the bound: the mean sits well inside the bounds.
    assert size / 4 < sum(lengths) / len(lengths) < 3 * size / 4
    assert sum(n == size for n in lengths) < len(lengths) / 2


def test_a_short_tail_joins_the_window_before_it() -> None:
    ids = _tokens(3000, 5)
    cuts = cut_points(ids, 64, 4)
    cut = cuts[-2]
    # Cut the text 2 tokens past a cut: the 2-token tail joins the window before.
    assert cut_points(ids[: cut + 2], 64, 4)[-1] == cut + 2
    assert cut not in cut_points(ids[: cut + 2], 64, 4)


def test_the_cuts_are_pinned_across_processes_and_versions() -> None:
    # Servers sharing a store must key a message alike: these values may never change.
    assert cut_points(list(range(1000, 1600)), 128, 4) == GOLDEN


GOLDEN = [42, 98, 226, 287, 415, 458, 556, 595, 600]


def test_an_edit_changes_only_the_windows_around_it() -> None:
    size = 128
    ids = _tokens(4000, 11)
    edited = ids[:1500] + [17, 18, 19, 20, 21] + ids[1500:]
    old, new = _windows(ids, size), _windows(edited, size)
    assert _windows(ids, size) == old  # deterministic
    before = [w for w, end in zip(old, cut_points(ids, size, 4), strict=True) if end <= 1500]
    assert new[: len(before)] == before
    # Past the edit the cuts meet again: all but a few windows are shared.
    shared = len(set(old) & set(new))
    assert shared >= len(old) - 4
    # Fixed windows from the start would share only those before the edit.
    fixed_old = {tuple(ids[i : i + size]) for i in range(0, len(ids), size)}
    fixed_new = {tuple(edited[i : i + size]) for i in range(0, len(edited), size)}
    assert len(fixed_old & fixed_new) <= 1500 // size + 1 < shared


def test_the_decision_reads_a_bounded_window() -> None:
    # The same WINDOW tokens before a position decide the same way whatever precedes them,
    # once the length since the last cut allows a cut.
    ids = _tokens(2000, 3)
    cuts = set(cut_points(ids, 256, 4))
    shifted = _tokens(300, 99) + ids
    later = {c - 300 for c in cut_points(shifted, 256, 4) if c > 300 + WINDOW}
    assert len(cuts & later) >= len(cuts) - 3


def test_bad_sizes_are_errors() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        cut_points([1, 2, 3], 0, 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        cut_points([1, 2, 3], 8, 0)
