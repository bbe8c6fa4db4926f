"""The correctness gate on the embedded model: a verdict per check, JSON, and failures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from sgl_pic.cli.check import (
    CheckThresholds,
    FloorMeasure,
    main,
    measure_floor,
    run_check,
    with_multiples,
)
from sgl_pic.cli.launch_server import _model_check
from sgl_pic.config import PicConfig
from sgl_pic.fidelity import oracle_in_dtype
from sgl_pic.oracle import Oracle


def test_default_policy_passes_and_writes_json(
    embedded_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    # The precision floor beside it: bfloat16 exact prefill drifts, less than reuse does.
    floor = report["floor"]
    assert floor["dtype"] == "bfloat16"
    assert floor["kl"] > 0 and 0 <= floor["agreement"] <= 1 and 0 <= floor["top1"] <= 1
    assert 1 < floor["policy_kl_multiple"] < floor["full_reuse_kl_multiple"]
    assert floor["policy_kl_multiple"] / floor["full_reuse_kl_multiple"] == pytest.approx(
        by_name["kl"]["value"]
    )
    printed = capsys.readouterr().out
    assert f"reuse drift = {floor['policy_kl_multiple']:.1f}x bf16 drift" in printed


def test_precision_floor_on_the_tiny_model(tiny_oracle: Oracle) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (20, 33)]
    refs = [tiny_oracle.prefill(ids) for ids in prompts]
    logits = [r.logits for r in refs]
    tokens = [tiny_oracle.generate(r.kv, r.logits, 8) for r in refs]
    low = measure_floor(oracle_in_dtype(tiny_oracle, torch.bfloat16), prompts, logits, tokens)
    assert low.dtype == "bfloat16" and low.kl > 0
    assert 0 <= low.agreement <= 1 and 0 <= low.top1 <= 1
    same = measure_floor(oracle_in_dtype(tiny_oracle, torch.float32), prompts, logits, tokens)
    assert same == FloorMeasure("float32", 0.0, 1.0, 1.0)
    floor = with_multiples(low, policy_kl=10 * low.kl, full_reuse_kl=40 * low.kl)
    assert floor.policy_kl_multiple == pytest.approx(10)
    assert floor.full_reuse_kl_multiple == pytest.approx(40)
    assert with_multiples(same, 0.1, 0.3).policy_kl_multiple == 0.0  # no drift: no multiple
    with pytest.raises(ValueError):
        measure_floor(oracle_in_dtype(tiny_oracle, torch.bfloat16), prompts, logits[:1], tokens)


def test_reusing_everything_fails_and_refuses_reuse(embedded_path: str, tmp_path: Path) -> None:
    ns = argparse.Namespace(pic_check_out=str(tmp_path / "gate.json"))
    reason = _model_check(embedded_path, PicConfig(policy="full_reuse"), ns)
    assert reason.startswith("the model failed --pic-check: kl:"), reason
    report = json.loads((tmp_path / "gate.json").read_text())
    assert report["passed"] is False
    kl = next(c for c in report["checks"] if c["name"] == "kl")
    assert kl["value"] == pytest.approx(1.0)  # full reuse against itself


def test_a_gate_that_cannot_run_refuses_reuse_and_the_launch_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sgl_pic.cli import check

    def broken(*_args: object, **_kwargs: object) -> None:
        raise MemoryError("no room for the oracle")

    monkeypatch.setattr(check, "run_check", broken)
    ns = argparse.Namespace(pic_check_out="")
    reason = _model_check("org/model", PicConfig(), ns)
    assert reason == "--pic-check could not run on the model (MemoryError: no room for the oracle)"


def test_a_directory_without_a_model_fails_with_the_reason(tmp_path: Path) -> None:
    report = run_check(tmp_path)
    assert not report.passed
    assert [c.name for c in report.checks] == ["load"]
    assert report.floor is None
    assert "cannot check this model" in report.failures


@pytest.mark.parametrize(
    "kw", [{"max_kl_ratio": 0.0}, {"min_agreement": 1.5}, {"new_tokens": 0}, {"exact_tol": -1.0}]
)
def test_thresholds_are_validated(kw: dict) -> None:
    with pytest.raises(ValueError):
        CheckThresholds(**kw)


def test_the_gate_encodes_chunks_as_the_server_stores_them(tiny_oracle: Oracle) -> None:
    """Under ``chunk_context="first_chunk"`` every chunk past the first is encoded after
    exact prefill of the prompt through the first chunk (a header before it included); at
    a full budget reuse over them is still exact prefill."""
    from sgl_pic.cli.check import served_chunks
    from sgl_pic.layout import PromptLayout
    from sgl_pic.selection import make_policy

    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(5))
    layout = PromptLayout.from_spans(40, [[2, 12], [12, 22], [25, 35]])
    alone = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    assert served_chunks(tiny_oracle, ids, layout, PicConfig(), alone) is alone
    config = PicConfig(chunk_context="first_chunk")
    chunks = served_chunks(tiny_oracle, ids, layout, config, alone)
    assert chunks[0] is alone[0]
    prefix = tiny_oracle.prefill(ids[:12]).kv
    for got, s in zip(chunks[1:], layout.chunks[1:], strict=True):
        want = tiny_oracle.encode_chunk(ids[s.start : s.end], prefix=prefix)
        assert got.base_position == 12 and torch.equal(got.kv.v, want.kv.v)
        assert not torch.allclose(got.kv.v, alone[layout.chunks.index(s)].kv.v)
    full = tiny_oracle.prefill(ids).logits
    exact = config.with_overrides(qa_ratio=1.0)
    got = tiny_oracle.reuse(ids, layout, chunks, make_policy(exact)).logits
    assert torch.allclose(got, full, atol=1e-4)
