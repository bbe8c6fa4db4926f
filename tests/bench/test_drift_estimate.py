"""bench/drift_estimate.py's pieces: rank correlation, the signals of one selection, and
a fit that recovers a known log-linear law and ranks held-out requests by it."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from sgl_pic.layout import PromptLayout, Span
from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def study() -> ModuleType:
    return load_script("drift_estimate")


def test_spearman(study: ModuleType) -> None:
    assert study.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert study.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert study.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(study.spearman([1, 2], [1, 2]))
    with pytest.raises(ValueError):
        study.spearman([1, 2, 3], [1, 2])


def test_signals_of_one_selection(study: ModuleType) -> None:
    layout = PromptLayout(10, (Span(0, 3), Span(3, 6), Span(6, 9)))
    attention = torch.tensor([0.0, 1, 1, 2, 1, 1, 2, 1, 0, 1])  # total 10
    deviation = torch.tensor([0.0, 0, 0, 4, 1, 1, 2, 2, 2, 0])
    reused = torch.tensor([4, 5, 6, 7, 8])  # token 3, chunk 2's sink, was recomputed
    s = study.signals(attention, deviation, layout, reused, reusable=6)
    assert s["attention_reused"] == pytest.approx(0.5)
    assert s["attention_sinks_reused"] == pytest.approx(0.2)  # token 6 only
    assert s["deviation"] == pytest.approx(8 / 5)
    assert s["deviation_x_attention"] == pytest.approx((1 + 1 + 4 + 2 + 0) / 10)
    assert s["reused_fraction"] == pytest.approx(5 / 6)


def test_fit_recovers_a_log_linear_law(study: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    features = ("attention_reused", "deviation")
    rows = []
    for i in range(40):
        a, d = (float(x) for x in torch.rand(2, generator=gen) + 0.05)
        rows.append(
            {"config": f"c{i % 2}", "attention_reused": a, "deviation": d, "kl": 0.5 * a**2 * d}
        )
    coef = study.fit(rows[:30], features, ridge=0.0)
    assert coef.tolist() == pytest.approx([math.log(0.5), 2.0, 1.0], abs=1e-3)
    judged = study.judge(rows[30:], coef, features)
    assert judged["spearman_all"] == pytest.approx(1.0)
    assert judged["spearman_within_config_mean"] == pytest.approx(1.0)
