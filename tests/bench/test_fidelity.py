"""bench/fidelity.py's command line, its independence from bench/diagnose.py, and its
summary of the new figures (intervals, the bfloat16 floor's multiples)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.bench.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_help_prints_and_exits_zero() -> None:
    out = subprocess.run(
        [sys.executable, "bench/fidelity.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "--continuation-tokens" in out.stdout and "at 15%" in out.stdout


def test_neither_benchmark_imports_the_other() -> None:
    code = "import sys; sys.path.insert(0, 'bench'); import {0}; print({1!r} in sys.modules)"
    both = [
        _python(code.format(a, b)) for a, b in (("diagnose", "fidelity"), ("fidelity", "diagnose"))
    ]
    assert both == ["False", "False"]


@pytest.fixture(scope="module")
def bench_fidelity() -> ModuleType:
    return load_script("fidelity")


def _row(variant: str, policy: str, example: int, kl: float, tf_top1: float) -> dict:
    return {
        "example": example,
        "variant": variant,
        "policy": policy,
        "recompute_fraction": 0.0,
        "computed_fraction": 0.1,
        "kl": kl,
        "top1": 1.0,
        "greedy_agreement": 0.5,
        "kv_deviation": 0.2,
        "f1": 0.0,
        "tf_kl": 2 * kl,
        "tf_top1": tf_top1,
        "tf_positions": 10,
        "rouge_l": 0.7,
        "time_ratio": 0.5,
        "selection_s": 0.0,
        "selection_share": 0.0,
    }


def test_summary_has_intervals_and_floor_multiples(bench_fidelity: ModuleType) -> None:
    reuse = bench_fidelity.Variant("full_reuse", "full_reuse", (), True)
    floor = bench_fidelity.floor_variant("bfloat16")
    rows = [_row("full_reuse", "full_reuse", e, 0.3 + 0.1 * e, 0.8) for e in range(4)]
    rows += [_row(floor.label, floor.policy, e, 0.005, 0.98) for e in range(4)]
    reuse_s, floor_s = bench_fidelity.summarize(rows, [reuse, floor])
    assert reuse_s["kl"] == pytest.approx(0.45)
    assert reuse_s["kl_over_bfloat16"] == pytest.approx(0.45 / 0.005)
    assert reuse_s["tf_kl_over_bfloat16"] == pytest.approx(0.45 / 0.005)
    assert floor_s["floor"] and not reuse_s["floor"] and floor_s["kl_over_bfloat16"] == 1.0
    for key in ("kl", "top1", "greedy_agreement", "tf_kl", "tf_top1", "rouge_l"):
        lo, hi = reuse_s[key + "_ci95"]
        assert lo <= reuse_s[key] <= hi
    assert reuse_s["kl_ci95"][0] < reuse_s["kl_ci95"][1]


def test_summary_of_older_results_keeps_their_figures(bench_fidelity: ModuleType) -> None:
    reuse = bench_fidelity.Variant("full_reuse", "full_reuse", (), True)
    old = [_row("full_reuse", "full_reuse", e, 0.3, 0.8) for e in range(3)]
    for r in old:
        for k in ("tf_kl", "tf_top1", "tf_positions", "rouge_l"):
            del r[k]
    (s,) = bench_fidelity.summarize(old, [reuse])
    assert s["kl"] == pytest.approx(0.3) and "tf_kl" not in s and "kl_over_bfloat16" not in s
    assert s["floor"] is False


def test_chunk_encodings_attend_to_the_prefix_they_name(
    bench_fidelity: ModuleType, tiny_oracle
) -> None:
    """Each encoding's passage KV is exact prefill of [its prefix, the passage]: nothing
    before it for "independent", the prompt's first token for "sink_prefix", the whole
    system chunk for "system_prefix"; the system chunk is the same in all three."""
    from sgl_pic.layout import PromptLayout

    torch.manual_seed(3)
    ids = torch.randint(0, 97, (40,))
    layout = PromptLayout.from_lengths([10, 12, 14], fresh_tail=4)
    system, passage = layout.chunks[0], layout.chunks[2]
    prefixes = {"independent": 0, "sink_prefix": 1, "system_prefix": system.end}
    got = bench_fidelity.encode_chunks(tiny_oracle, ids, layout, bench_fidelity.ENCODINGS, None)
    for enc, chunks in got.items():
        assert torch.equal(chunks[0].kv.k, got["independent"][0].kv.k)
        p = prefixes[enc]
        exact = tiny_oracle.prefill(torch.cat([ids[:p], ids[passage.start : passage.end]])).kv
        assert chunks[2].base_position == p
        torch.testing.assert_close(chunks[2].kv.k, exact.k[:, p:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(chunks[2].kv.v, exact.v[:, p:], rtol=1e-4, atol=1e-5)
    # The corrections change what the passage attended to: their KV differs.
    assert not torch.allclose(got["sink_prefix"][2].kv.v, got["independent"][2].kv.v)
    with pytest.raises(ValueError, match="unknown encoding"):
        bench_fidelity.encode_chunks(tiny_oracle, ids, layout, ["nope"], None)
