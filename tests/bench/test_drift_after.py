"""bench/drift_after.py's pieces: the recomputed rows' K/V change, the one-pass signals of
one selection, and an analysis that finds a signal which follows KL and one which does not."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import ModuleType

import pytest
import torch

from sgl_pic.layout import PromptLayout, Span
from sgl_pic.oracle.forward import KVCache
from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def study() -> ModuleType:
    return load_script("drift_after")


def test_relative_change(study: ModuleType) -> None:
    old = KVCache(torch.ones(2, 4, 1, 2), torch.ones(2, 4, 1, 2))
    new = old.clone()
    new.k[1, 2] += torch.tensor([[3.0, 4.0]])  # |dK| = 5 at layer 1, row 2
    change = study.relative_change(new, old, torch.tensor([0, 2]))
    base = 2 * 2**0.5  # |K| + |V| of a row of ones
    assert change.shape == (2, 2)
    assert change[0].tolist() == [0.0, 0.0]
    assert change[1, 0] == 0.0
    assert change[1, 1] == pytest.approx(5 / base)


def test_chunk_index(study: ModuleType) -> None:
    layout = PromptLayout(8, (Span(0, 2), Span(3, 6)))
    assert study.chunk_index(layout).tolist() == [0, 0, -1, 1, 1, 1, -1, -1]


def test_after_signals(study: ModuleType) -> None:
    # Two layers; chunk 0 = rows 0-2, chunk 1 = rows 3-5, question rows 6-7.
    attention = torch.tensor(
        [
            [1.0, 1, 0, 2, 0, 0, 3, 3],  # total 10
            [2.0, 0, 1, 1, 1, 1, 2, 2],  # total 10
        ]
    )
    chunk_of = torch.tensor([0, 0, 0, 1, 1, 1, -1, -1])
    recomputed = torch.tensor([1, 3])
    reused = torch.tensor([2, 4, 5])
    change = torch.tensor([[0.5, 0.1], [0.2, 0.4]])  # [layer, recomputed row]
    s = study.after_signals(attention, change, recomputed, reused, chunk_of, 2)
    assert s["attention_reused"] == pytest.approx((0.0 + 0.3) / 2)
    assert s["attention_reused_deep"] == pytest.approx(0.3)  # layer 1 only
    assert s["deviation_recomputed"] == pytest.approx(0.3)
    assert s["deviation_recomputed_deep"] == pytest.approx(0.3)
    # Layer 1: row 2 (chunk 0, mean change 0.2) x 1, rows 4-5 (chunk 1, 0.4) x 1 each.
    assert s["residual_deep"] == pytest.approx((0.2 + 0.4 + 0.4) / 10)
    # Layer 0: rows 1, 3 attended 1 and 2: (0.5 + 0.2) / 3; layer 1: 0 and 1: 0.4.
    assert s["attended_change"] == pytest.approx(((0.5 * 1 + 0.1 * 2) / 3 + 0.4) / 2)


def test_after_signals_without_recomputed_rows(study: ModuleType) -> None:
    attention = torch.ones(2, 4)
    s = study.after_signals(
        attention,
        torch.empty(2, 0),
        torch.empty(0, dtype=torch.int64),
        torch.tensor([1, 2]),
        torch.tensor([0, 0, 0, -1]),
        1,
    )
    assert s["attention_reused"] == pytest.approx(0.5)
    assert s["deviation_recomputed"] == 0.0
    assert s["residual_deep"] == 0.0


def test_analyse_tells_a_signal_that_follows_kl_from_noise(study: ModuleType) -> None:
    rng = random.Random(0)
    rows = []
    for ex in range(30):
        for config, scale in (("a", 1.0), ("b", 0.5)):
            kl = scale * rng.uniform(0.01, 1.0)
            noise = rng.uniform(0.01, 1.0)
            row = {"config": config, "example": ex, "kl": kl}
            row.update(dict.fromkeys(study.SIGNALS, noise))
            row["distance_to_full_reuse"] = 0.3 * kl**0.8  # a law the fit can learn
            rows.append(row)
    out = study.analyse(rows, fit_examples=15, ridge=1e-6)
    signals = out["signals_held_out_within"]
    assert signals["distance_to_full_reuse"]["mean"] == pytest.approx(1.0)
    assert abs(signals["residual_deep"]["mean"]) < 0.6
    held = out["estimators"]["distance_to_full_reuse"]["held_out"]
    assert held["spearman_within_config_mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="both sides"):
        study.analyse(rows, fit_examples=30, ridge=1e-6)


def test_confidence(study: ModuleType) -> None:
    flat = study.confidence(torch.zeros(4))
    assert flat["entropy"] == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert flat["top1_margin"] == pytest.approx(0.0)
    peaked = study.confidence(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    assert peaked["entropy"] < 0.01
    assert peaked["top1_margin"] == pytest.approx(1.0, abs=1e-3)


def test_rung_fit_recovers_a_law_with_one_intercept_per_budget(study: ModuleType) -> None:
    rows = [
        {"config": c, "entropy": h, "kl": math.exp(a + 1.5 * math.log(h))}
        for c, a in (("low", -1.0), ("high", -3.0))
        for h in (0.2, 0.5, 1.0, 2.0)
    ]
    intercepts, slope = study.rung_fit(rows, "entropy")
    assert slope == pytest.approx(1.5, abs=1e-4)
    assert intercepts["low"] == pytest.approx(-1.0, abs=1e-4)
    assert intercepts["high"] == pytest.approx(-3.0, abs=1e-4)


def test_ladder_climbs_until_the_estimate_meets_the_target(study: ModuleType) -> None:
    def row(ex: int, frac: float, kl: float) -> dict:
        return {"example": ex, "recompute_fraction": frac, "kl": kl}

    rows = [
        row(0, 0.1, 0.05),  # met at the first rung
        row(0, 0.3, 0.01),
        row(1, 0.1, 0.20),
        row(1, 0.3, 0.08),  # met at the second
        row(2, 0.3, 0.50),  # never met: exact prefill
        row(2, 0.1, 0.90),
    ]
    out = study.ladder(rows, lambda r: r["kl"], 0.1)
    assert out["met"] == 1.0
    assert out["recompute_served"] == pytest.approx((0.1 + 0.3 + 1.0) / 3)
    assert out["recompute_tried"] == pytest.approx((0.1 + 0.4 + 1.4) / 3)
    assert out["kl_mean"] == pytest.approx((0.05 + 0.08 + 0.0) / 3)
    # An estimate that is always too low serves the first rung whatever its KL.
    low = study.ladder(rows, lambda r: 0.0, 0.1)
    assert low["met"] == pytest.approx(1 / 3)
    assert low["recompute_served"] == pytest.approx(0.1)


def test_a_one_budget_ladder_sends_what_it_misses_to_exact_prefill(study: ModuleType) -> None:
    def row(ex: int, config: str, frac: float, kl: float) -> dict:
        return {"example": ex, "config": config, "recompute_fraction": frac, "kl": kl}

    rows = [
        row(0, "low", 0.1, 0.05),  # met at the one rung
        row(0, "high", 0.3, 0.01),
        row(1, "low", 0.1, 0.20),  # missed: exact prefill, though "high" would meet it
        row(1, "high", 0.3, 0.08),
    ]
    out = study.ladder(rows, lambda r: r["kl"], 0.1, config="low")
    assert out["met"] == 1.0
    assert out["recompute_served"] == pytest.approx((0.1 + 1.0) / 2)
    assert out["recompute_tried"] == pytest.approx((0.1 + 1.1) / 2)
    assert out["kl_mean"] == pytest.approx(0.05 / 2)


def test_at_the_fixed_compute_the_worst_ranked_go_to_exact_prefill(study: ModuleType) -> None:
    rows = [
        {"example": i, "config": "low", "recompute_fraction": 0.1, "kl": kl}
        for i, kl in enumerate([0.9, 0.1, 0.2, 0.3, 0.05])
    ]
    # Five requests at 0.1 each spend 0.5; one exact prefill more is 1.5 / 5 = 0.3.
    out = study.to_exact_within(rows, lambda r: r["kl"], "low", 0.3)
    assert out["to_exact"] == pytest.approx(0.2)
    assert out["recompute_tried"] == pytest.approx(0.3)
    assert out["kl_mean"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.05) / 5)
    # Below that budget nothing is sent; a wrong ranking sends the wrong request.
    assert study.to_exact_within(rows, lambda r: r["kl"], "low", 0.29)["to_exact"] == 0.0
    wrong = study.to_exact_within(rows, lambda r: -r["kl"], "low", 0.3)
    assert wrong["kl_mean"] == pytest.approx((0.9 + 0.1 + 0.2 + 0.3) / 5)
    # Below the base rung's own spend the budget cannot be kept.
    with pytest.raises(ValueError, match="over"):
        study.to_exact_within(rows, lambda r: r["kl"], "low", 0.05)


def _study_rows(study: ModuleType) -> list[dict]:
    """Examples 0-29 at the fixed budget and one below it, whose entropy is their KL's."""
    rng = random.Random(1)
    rows = []
    for ex in range(30):
        for config, frac in (("query_aware 0.05", 0.05), (study.FIXED, 0.15)):
            kl = rng.uniform(0.01, 1.0) * (2.0 if frac < 0.1 else 1.0)
            row = {"config": config, "example": ex, "kl": kl, "recompute_fraction": frac}
            row.update(dict.fromkeys(study.SIGNALS, rng.uniform(0.01, 1.0)))
            row["entropy"] = kl
            rows.append(row)
    return rows


def test_analyse_judges_one_budget_ladders_below_the_fixed_compute(study: ModuleType) -> None:
    lad = study.analyse(_study_rows(study), fit_examples=10, ridge=1e-6)["ladder"]
    assert lad["fixed"]["recompute"] == pytest.approx(0.15)
    # Every budget gets its one-rung ladders; at the fixed compute only a budget below it.
    assert set(lad["to_exact"]) == {"query_aware 0.05", study.FIXED}
    assert len(lad["to_exact"][study.FIXED]["entropy"]) == len(study.TARGETS_TO_EXACT)
    (within,) = lad["to_exact_at_fixed_compute"].values()
    # 20 held out at 0.05: one exact prefill more is (20 * 0.05 + 1) / 20 = 0.1, two 0.15.
    for name in ("entropy", "true"):
        assert within[name]["to_exact"] == pytest.approx(0.1)
        assert within[name]["recompute_tried"] <= 0.15 + 1e-9
    # The entropy ranks as the truth here, so both send the same requests.
    assert within["entropy"]["kl_p90"] == pytest.approx(within["true"]["kl_p90"])


def test_a_merge_of_a_merged_run_keeps_its_parts(study: ModuleType, tmp_path: Path) -> None:
    import json

    rows = _study_rows(study)
    parts = [{"file": "/tmp/a.json", "commit": {"commit": "a" * 40, "dirty": False}}]
    merged = {"benchmark": "drift_after", "commit": parts[0]["commit"], "parts": parts}
    src = tmp_path / "merged.json"
    src.write_text(json.dumps({**merged, "rows": rows}))
    out = tmp_path / "again.json"
    assert study.main(["--merge", str(src), "--fit-examples", "10", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["parts"] == parts and again["commit"] == parts[0]["commit"]
    assert set(again["analysis_commit"]) == {"commit", "dirty"}
    assert again["rows"] == rows
