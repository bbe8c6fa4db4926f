"""The correctness gate on the embedded model: a verdict per check, JSON, and failures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sgl_pic.check import CheckThresholds, main, run_check
from sgl_pic.config import PicConfig
from sgl_pic.launch_server import _model_check


def test_default_policy_passes_and_writes_json(embedded_path: str, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    assert main(["--model", embedded_path, "--out", str(out), "--threads", "2"]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["config"]["policy"] == PicConfig().policy
    by_name = {c["name"]: c for c in report["checks"]}
    assert set(by_name) == {"rotation", "exact", "kl", "agreement"}
    assert by_name["rotation"]["value"] < 1e-4
    assert by_name["exact"]["value"] < 1e-3
    # The budget recovers part of full reuse's loss, and the ratio is a real measurement.
    assert 0 < by_name["kl"]["value"] <= 0.5


def test_reusing_everything_fails_and_refuses_reuse(embedded_path: str, tmp_path: Path) -> None:
    ns = argparse.Namespace(pic_check_out=str(tmp_path / "gate.json"))
    reason = _model_check(embedded_path, PicConfig(policy="full_reuse"), ns)
    assert reason.startswith("the model failed --pic-check: kl:"), reason
    report = json.loads((tmp_path / "gate.json").read_text())
    assert report["passed"] is False
    kl = next(c for c in report["checks"] if c["name"] == "kl")
    assert kl["value"] == pytest.approx(1.0)  # full reuse against itself


def test_a_directory_without_a_model_fails_with_the_reason(tmp_path: Path) -> None:
    report = run_check(tmp_path)
    assert not report.passed
    assert [c.name for c in report.checks] == ["load"]
    assert "cannot check this model" in report.failures


@pytest.mark.parametrize(
    "kw", [{"max_kl_ratio": 0.0}, {"min_agreement": 1.5}, {"new_tokens": 0}, {"exact_tol": -1.0}]
)
def test_thresholds_are_validated(kw: dict) -> None:
    with pytest.raises(ValueError):
        CheckThresholds(**kw)
