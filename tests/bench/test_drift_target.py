"""bench/drift_target.py: the estimator fit, its held-out judgement and the budget ladder,
on synthetic fidelity rows whose truth is known."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def drift_target() -> ModuleType:
    return load_script("drift_target")


def _rows(module: ModuleType, examples: int) -> list[dict]:
    """Example e's KL at rung i is h_e / (i + 1): hardness h_e, less drift higher up. The
    distance to full reuse reads h_e exactly; the distance to the next rung is noise."""
    rows = []
    for e in range(examples):
        hard = 0.01 * (1 + (e * 7) % examples)
        rows.append(
            {
                "example": e,
                "variant": "full_reuse",
                "kl": 2 * hard,
                "recompute_fraction": 0.0,
                "kl_to": {},
            }
        )
        for i, rung in enumerate(module.LADDER):
            others = {
                label: 1e-3 * (1 + (e * 13 + i) % 5) for label in module.LADDER if label != rung
            }
            others["full_reuse"] = hard**2
            rows.append(
                {
                    "example": e,
                    "variant": rung,
                    "kl": hard / (i + 1),
                    "recompute_fraction": (0.05, 0.1, 0.15, 0.3)[i],
                    "kl_to": others,
                }
            )
    return rows


def test_fit_recovers_a_power_law_and_ranks_held_out_requests(drift_target: ModuleType) -> None:
    rows = [r for r in _rows(drift_target, 12) if r["variant"] != "full_reuse"]
    f = drift_target.fit(rows[:24], "to_full_reuse")
    assert f.slope == pytest.approx(0.5, abs=1e-2)  # KL ~ sqrt(signal), up to EPS
    for i, rung in enumerate(drift_target.LADDER):
        assert f.intercepts[rung] == pytest.approx(-math.log(i + 1), abs=2e-2)
    held = drift_target.judge(rows[24:], "to_full_reuse", f)
    assert held["spearman_within_budget_mean"] == pytest.approx(1.0)
    noise = drift_target.judge(
        rows[24:], "to_next_budget", drift_target.fit(rows[:24], "to_next_budget")
    )
    assert noise["spearman_within_budget_mean"] < 0.9


def test_ladder_climbs_until_the_estimate_meets_the_target(drift_target: ModuleType) -> None:
    by_example = {0: {}, 1: {}}
    for r in _rows(drift_target, 2):
        if r["variant"] != "full_reuse":
            by_example[r["example"]][r["variant"]] = r
    none = drift_target.Fit({}, 0.0)
    # Example 0 (h=0.01) meets 0.004 at the third rung; example 1 (h=0.02) at none, so
    # it is served exactly, after trying every rung.
    out = drift_target.ladder(by_example, "true", none, 0.004)
    assert out["met"] == 1.0
    assert out["recompute_served"] == pytest.approx((0.15 + 1.0) / 2)
    assert out["recompute_tried"] == pytest.approx((0.05 + 0.1 + 0.15 + 0.6 + 1.0) / 2)
    assert out["kl_p90"] == pytest.approx(0.01 / 3)


def test_main_writes_a_judgement_and_refuses_older_runs(
    drift_target: ModuleType, tmp_path: Path
) -> None:
    src = tmp_path / "fidelity.json"
    src.write_text(json.dumps({"rows": _rows(drift_target, 8)}))
    out = tmp_path / "out.json"
    assert drift_target.main([str(src), "--fit-examples", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["held_out_examples"] == 4
    assert result["estimators"]["to_full_reuse"]["held_out"]["spearman_all"] > 0.5
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [{**r, "kl_to": None} for r in _rows(drift_target, 2)]}))
    with pytest.raises(SystemExit):
        drift_target.main([str(old), "--out", str(out)])
