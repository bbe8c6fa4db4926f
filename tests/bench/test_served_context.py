"""bench/served_context.py's pieces: the KL and agreement it reads from server answers,
and its summary (the paired ratio interval is ``fidelity.paired_ratio_ci``'s, tested in
tests/test_fidelity.py)."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("served_context")


def answer(logprobs: dict[int, float]) -> dict:
    return {"meta_info": {"output_top_logprobs": [[[lp, t, None] for t, lp in logprobs.items()]]}}


def test_kl_of_server_answers(bench: ModuleType) -> None:
    p = {0: math.log(0.5), 1: math.log(0.5)}
    q = {0: math.log(0.9), 1: math.log(0.1)}
    got = bench.kl(bench.first_logprobs(answer(p)), bench.first_logprobs(answer(q)))
    assert got == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    assert bench.kl(p, p) == 0.0


def test_agreement_stops_at_the_first_divergence(bench: ModuleType) -> None:
    assert bench.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert bench.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert bench.agreement([1, 2, 3, 4], [7, 2, 3, 4]) == 0.0


def test_summary_pairs_the_settings(bench: ModuleType) -> None:
    rows = [
        {
            "example": i,
            "setting": s,
            "first_token_kl": kl,
            "greedy_agreement": 1.0,
            "full_reuse_kl": 0.4,
            "recomputed_tokens": 15.0,
            "reused_tokens": 85.0,
        }
        for i in range(4)
        for s, kl in (("none", 0.2), ("first_chunk", 0.1))
    ]
    out = bench.summary(rows)
    assert out["kl_first_chunk_over_none"] == pytest.approx(0.5)
    assert out["none"]["kl_over_full_reuse"] == pytest.approx(0.5)
    assert out["first_chunk"]["kl_over_full_reuse"] == pytest.approx(0.25)
    assert out["none"]["recomputed_fraction"] == pytest.approx(0.15)
