"""``bench/itl.py``'s arithmetic: which gaps of the decoding request count as during the
prompt, and the summary of paired repetitions."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("itl")


def test_the_gaps_during_the_prompt_are_those_overlapping_it(bench: ModuleType) -> None:
    # Tokens every 0.1 s, then a 2 s wait, one token, a 3 s wait (the prompt was in the
    # server from 0.35 s to 5.3 s), then 0.1 s again.
    times = [0.0, 0.1, 0.2, 0.3, 2.3, 5.3, 5.4]
    during, itl = bench.gaps(times, 0.35, 5.3)
    assert during == pytest.approx([2.0, 3.0])
    assert itl == pytest.approx(0.1)
    # A prompt that ends just before an arrival still owns the gap it ended in.
    during, _ = bench.gaps(times, 0.35, 2.29)
    assert during == pytest.approx([2.0])


def test_the_summary_pairs_each_repetition(bench: ModuleType) -> None:
    def rec(plain: float, chunked: float, ok: bool = True) -> dict:
        return {
            "plain": {"gap_s": plain, "itl_s": 0.1},
            "chunked": {"gap_s": chunked, "itl_s": 0.1},
            "gap_ratio": chunked / plain,
            "stretch_ratio": (chunked - 0.1) / (plain - 0.1),
            "check": ok,
        }

    s = bench.summary([rec(1.0, 1.2), rec(2.0, 1.0), rec(1.0, 1.5)])
    assert s["gap_ratio_median"] == pytest.approx(1.2)
    assert s["gap_ratio_max"] == pytest.approx(1.5)
    assert s["plain_gap_s_median"] == pytest.approx(1.0)
    assert s["checks_ok"]
    assert not bench.summary([rec(1.0, 1.0), rec(1.0, 1.0, ok=False)])["checks_ok"]
