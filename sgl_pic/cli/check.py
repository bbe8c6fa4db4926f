"""A per-model correctness gate for chunk reuse.

    python -m sgl_pic.check --model PATH [--out check.json]

Reuse is an approximation whose quality depends on the model, so before a model serves
chunked requests this checks, with the plain-torch oracle over the model's own weights and
the built-in prompts of ``check_prompts``:

1. ``rotation``: a chunk encoded at position 0 and re-rotated to a far position has the
   keys (and values) of the same chunk encoded there, at every layer: the model's attention
   depends on relative positions only, so moving KV is exact;
2. ``exact``: full recompute, and the policy at a budget of every reused token where it has
   one, give full prefill's next-token logits;
3. ``kl`` and ``agreement``: at the configured policy and budget, the first-token KL to full
   prefill is at most ``max_kl_ratio`` of full reuse's, and greedy agreement over
   ``new_tokens`` tokens is at least ``min_agreement``.

Beside them it reports the model's precision floor: exact prefill of the same model in
bfloat16 against float32 on the same prompts, the drift every GPU user already accepts,
and the policy's drift as a multiple of it ("reuse drift = N x bf16 drift"). The floor is
information for the operator: it takes no part in the verdict.

It prints one line per check and a verdict, writes the report as JSON, and exits 1 when the
model fails. ``python -m sgl_pic.launch_server --pic-check`` runs it before the server
starts and refuses reuse for a model that fails (every request then runs as exact prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from sgl_pic.config import FULL_BUDGET_FIELDS, PicConfig
from sgl_pic.fidelity import first_token_kl, greedy_agreement, oracle_in_dtype, top1_agrees
from sgl_pic.layout import PromptLayout

if TYPE_CHECKING:
    from sgl_pic.oracle import Oracle
    from sgl_pic.oracle.oracle import ChunkKV
    from sgl_pic.prompts import ChunkedPrompt

# Far enough that a rotation error in any frequency band shows, within every model's range.
ROTATION_SHIFT = 3000


@dataclass(frozen=True)
class CheckThresholds:
    """rotation_tol: largest error of moved K/V, relative to the largest |K| or |V|.
    exact_tol:       largest |logit| difference of exact paths to full prefill.
    max_kl_ratio:    the policy's mean first-token KL over full reuse's, at most.
    min_agreement:   the policy's mean greedy agreement with full prefill, at least.
    new_tokens:      greedy tokens compared."""

    rotation_tol: float = 1e-3
    exact_tol: float = 1e-3
    max_kl_ratio: float = 0.5
    min_agreement: float = 0.5
    new_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("rotation_tol", "exact_tol", "max_kl_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError(f"min_agreement must be in [0, 1], got {self.min_agreement}")
        if not 1 <= self.new_tokens <= 256:
            raise ValueError(f"new_tokens must be in [1, 256], got {self.new_tokens}")


@dataclass(frozen=True)
class CheckResult:
    """One check: its measured value against its threshold, and what it means."""

    name: str
    passed: bool
    value: float
    threshold: float
    detail: str


@dataclass(frozen=True)
class PrecisionFloor:
    """Exact prefill of the model in ``dtype`` against float32 on the check's prompts
    (means over them), and the checked policy's and full reuse's first-token KL as
    multiples of the floor's KL (0 when the floor's KL is 0)."""

    dtype: str
    kl: float
    top1: float
    agreement: float  # greedy agreement over the check's new_tokens
    policy_kl_multiple: float
    full_reuse_kl_multiple: float


@dataclass(frozen=True)
class CheckReport:
    model: str
    config: dict[str, Any]
    thresholds: dict[str, Any]
    checks: tuple[CheckResult, ...]
    passed: bool
    prompts: int
    wall_s: float
    floor: PrecisionFloor | None = None  # None when the model could not be checked

    @property
    def failures(self) -> str:
        """The failed checks in one line ('' when the model passed)."""
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.passed)


def served_chunks(
    oracle: Oracle,
    ids: torch.Tensor,  # [N] the prompt
    layout: PromptLayout,
    config: PicConfig,
    alone: list[ChunkKV],
) -> list[ChunkKV]:
    """The chunk KV the server would store for this prompt under ``config``: ``alone``
    (each chunk encoded alone), or under ``chunk_context="first_chunk"`` every chunk past
    the first encoded after exact prefill of the prompt's tokens through the first chunk
    (what phase 1 encodes it after)."""
    if config.chunk_context == "none" or len(layout.chunks) < 2:
        return alone
    end = layout.chunks[0].end
    context = oracle.prefill(ids[:end]).kv
    return [alone[0]] + [
        oracle.encode_chunk(ids[s.start : s.end], prefix=context) for s in layout.chunks[1:]
    ]


def run_check(
    model_path: str | Path,
    config: PicConfig | None = None,
    thresholds: CheckThresholds | None = None,
    floor: bool = True,
) -> CheckReport:
    """Runs every check on ``model_path`` (a Hugging Face model directory). A model the
    oracle cannot load fails with that reason instead of raising. ``floor``: also measure
    the bfloat16 precision floor (reported beside the figures, no part of the verdict)."""
    config = config or PicConfig()
    limits = thresholds or CheckThresholds()
    started = time.perf_counter()
    measured = None
    try:
        checks, prompts, measured = _checks(str(model_path), config, limits, floor)
    except Exception as e:  # noqa: BLE001 - any model the oracle cannot run fails the gate
        checks = [CheckResult("load", False, 0.0, 0.0, f"cannot check this model: {e!r}")]
        prompts = 0
    return CheckReport(
        model=str(model_path),
        config=asdict(config),
        thresholds=asdict(limits),
        checks=tuple(checks),
        passed=all(c.passed for c in checks),
        prompts=prompts,
        wall_s=time.perf_counter() - started,
        floor=measured,
    )


def _checks(
    path: str, config: PicConfig, limits: CheckThresholds, floor: bool = True
) -> tuple[list[CheckResult], int, PrecisionFloor | None]:
    """Every check of ``run_check`` on the model at ``path`` over the built-in prompts:
    the checks in order (rotation, exact, kl, agreement), the number of prompts, and the
    precision floor (None unless ``floor``). Raises where the model cannot be run."""
    import transformers

    from sgl_pic.cli.check_prompts import PASSAGES, PROMPTS, SYSTEM
    from sgl_pic.oracle import Oracle
    from sgl_pic.prompts import build_prompt

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    oracle = Oracle.from_pretrained(path)
    prompts = [
        build_prompt(tokenizer, [PASSAGES[i] for i in p.passages], p.question, SYSTEM)
        for p in PROMPTS
    ]
    out = [_rotation(oracle, prompts[0].token_ids, prompts[0].layout, limits)]
    exact_configs = _exact_configs(config)
    figures = _measure_prompts(oracle, prompts, config, exact_configs, limits.new_tokens)
    out += _figure_checks(figures, config, [c.policy for c in exact_configs], limits)
    if not floor:
        return out, len(prompts), None
    low = oracle_in_dtype(oracle, torch.bfloat16)
    measured = measure_floor(
        low, [p.token_ids for p in prompts], figures.ref_logits, figures.ref_tokens
    )
    return out, len(prompts), with_multiples(measured, figures.kl, figures.kl_reuse)


def _exact_configs(config: PicConfig) -> list[PicConfig]:
    """The configs that must give full prefill's logits: full recompute, and the
    configured policy at a budget of every reused token where it has one."""
    exact_configs = [config.with_overrides(policy="full_recompute")]
    full_budget = _full_budget(config)
    if full_budget is not None:
        exact_configs.append(full_budget)
    return exact_configs


class _PromptFigures(NamedTuple):
    """What ``_measure_prompts`` measured, one entry per prompt in each list."""

    worst_exact: float  # largest |logit| difference of an exact config to full prefill
    kls: list[float]  # the policy's first-token KL to full prefill
    reuse_kls: list[float]  # full reuse's (chunks encoded alone) first-token KL
    agreements: list[float]  # the policy's greedy agreement with full prefill
    ref_logits: list[torch.Tensor]  # each [vocab] exact float32 prefill's first logits
    ref_tokens: list[torch.Tensor]  # each [new_tokens] exact float32's greedy tokens

    @property
    def kl(self) -> float:
        """The policy's mean first-token KL."""
        return statistics.fmean(self.kls)

    @property
    def kl_reuse(self) -> float:
        """Full reuse's mean first-token KL."""
        return statistics.fmean(self.reuse_kls)


def _measure_prompts(
    oracle: Oracle,
    prompts: Sequence[ChunkedPrompt],
    config: PicConfig,
    exact_configs: Sequence[PicConfig],
    new_tokens: int,
) -> _PromptFigures:
    """Full prefill, every exact config, the configured policy and full reuse of chunks
    encoded alone on each prompt, with ``new_tokens`` greedy tokens of full prefill and
    the policy, compared."""
    from sgl_pic.selection import make_policy

    worst_exact, kls, reuse_kls, agreements = 0.0, [], [], []
    ref_logits, ref_tokens = [], []  # exact float32's, for the precision floor
    reuse = config.with_overrides(policy="full_reuse")
    for prompt in prompts:
        ids, layout = prompt.token_ids, prompt.layout
        full = oracle.prefill(ids)
        alone = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
        chunks = served_chunks(oracle, ids, layout, config, alone)
        for exact in exact_configs:
            res = oracle.reuse(ids, layout, chunks, make_policy(exact))
            worst_exact = max(worst_exact, float((res.logits - full.logits).abs().max()))
        ours = oracle.reuse(ids, layout, chunks, make_policy(config))
        # Full reuse of chunks encoded alone: the baseline every figure is read against.
        base = oracle.reuse(ids, layout, alone, make_policy(reuse))
        tokens = oracle.generate_batch(
            [full.kv, ours.kv], torch.stack([full.logits, ours.logits]), new_tokens
        )
        kls.append(first_token_kl(full.logits, ours.logits))
        reuse_kls.append(first_token_kl(full.logits, base.logits))
        agreements.append(greedy_agreement(tokens[0], tokens[1]))
        ref_logits.append(full.logits)
        ref_tokens.append(tokens[0])
    return _PromptFigures(worst_exact, kls, reuse_kls, agreements, ref_logits, ref_tokens)


def _figure_checks(
    figures: _PromptFigures, config: PicConfig, exact_names: list[str], limits: CheckThresholds
) -> list[CheckResult]:
    """The exact, kl and agreement checks of ``figures`` against ``limits``."""
    worst_exact, kl, kl_reuse = figures.worst_exact, figures.kl, figures.kl_reuse
    names = ", ".join(exact_names)
    ratio = kl / kl_reuse if kl_reuse > 0 else 0.0
    agreement = statistics.fmean(figures.agreements)
    return [
        CheckResult(
            "exact",
            worst_exact <= limits.exact_tol,
            worst_exact,
            limits.exact_tol,
            f"largest logit difference to full prefill of {names}: {worst_exact:.2e}",
        ),
        CheckResult(
            "kl",
            ratio <= limits.max_kl_ratio,
            ratio,
            limits.max_kl_ratio,
            f"{config.policy} first-token KL {kl:.4f} is {ratio:.2f} of full reuse's "
            f"{kl_reuse:.4f}",
        ),
        CheckResult(
            "agreement",
            agreement >= limits.min_agreement,
            agreement,
            limits.min_agreement,
            f"{config.policy} greedy agreement over {limits.new_tokens} tokens {agreement:.2f}",
        ),
    ]


class FloorMeasure(NamedTuple):
    """Exact prefill in ``dtype`` against float32: means over the prompts."""

    dtype: str
    kl: float
    top1: float
    agreement: float


def measure_floor(
    low: Oracle,
    prompts: Sequence[torch.Tensor],  # each [N] a prompt's token ids
    ref_logits: Sequence[torch.Tensor],  # each [vocab] float32 exact prefill's first logits
    ref_tokens: Sequence[torch.Tensor],  # each [new_tokens] exact's greedy tokens
) -> FloorMeasure:
    """Exact prefill of ``low`` (the model in a lower dtype, ``oracle_in_dtype``) on each
    prompt against float32 exact prefill's first logits and greedy continuation: means of
    first-token KL, top-1 and greedy agreement (``low`` decodes in its own dtype)."""
    if not len(prompts) == len(ref_logits) == len(ref_tokens) > 0:
        raise ValueError("need one reference per prompt, and at least one prompt")
    kls, top1s, agreements = [], [], []
    for ids, logits, tokens in zip(prompts, ref_logits, ref_tokens, strict=True):
        test = low.prefill(ids)
        kls.append(first_token_kl(logits, test.logits))
        top1s.append(float(top1_agrees(logits, test.logits)))
        agreements.append(
            greedy_agreement(tokens, low.generate(test.kv, test.logits, tokens.numel()))
        )
    return FloorMeasure(
        str(low.kv_dtype).removeprefix("torch."),
        statistics.fmean(kls),
        statistics.fmean(top1s),
        statistics.fmean(agreements),
    )


def with_multiples(floor: FloorMeasure, policy_kl: float, full_reuse_kl: float) -> PrecisionFloor:
    """The floor with the policy's and full reuse's first-token KL as multiples of it."""

    def times(kl: float) -> float:
        return kl / floor.kl if floor.kl > 0 else 0.0

    return PrecisionFloor(*floor, times(policy_kl), times(full_reuse_kl))


def _full_budget(config: PicConfig) -> PicConfig | None:
    """The configured policy at a budget of every reused token, where it has one."""
    field = FULL_BUDGET_FIELDS.get(config.policy)
    return None if field is None else config.with_overrides(**{field: 1.0})


def _rotation(
    oracle: Any,
    token_ids: torch.Tensor,  # [N] a prompt; its second chunk is moved
    layout: PromptLayout,
    limits: CheckThresholds,
) -> CheckResult:
    span = layout.chunks[min(1, len(layout.chunks) - 1)]
    ids = token_ids[span.start : span.end]
    at0 = oracle.encode_chunk(ids)
    far = oracle.encode_chunk(ids, start_position=ROTATION_SHIFT)
    n = ids.numel()
    old, new = torch.arange(n), torch.arange(ROTATION_SHIFT, ROTATION_SHIFT + n)
    # Each layer with its own table (Gemma 3's sliding and global layers differ).
    moved = torch.stack(
        [oracle.move_keys(li, at0.kv.k[li], old, new) for li in range(oracle.w.num_layers)]
    )
    k_err = float((moved.float() - far.kv.k.float()).abs().max() / far.kv.k.abs().max())
    v_err = float((at0.kv.v.float() - far.kv.v.float()).abs().max() / far.kv.v.abs().max())
    err = max(k_err, v_err)
    return CheckResult(
        "rotation",
        err <= limits.rotation_tol,
        err,
        limits.rotation_tol,
        f"K/V of a chunk moved by {ROTATION_SHIFT} positions vs encoded there: relative error "
        f"{err:.2e} (K {k_err:.2e}, V {v_err:.2e})",
    )


def print_report(report: CheckReport) -> None:
    print(f"sgl_pic check of {report.model} ({report.config['policy']}, {report.prompts} prompts)")
    for c in report.checks:
        mark = "PASS" if c.passed else "FAIL"
        print(f"  {mark} {c.name:<10} {c.detail} (threshold {c.threshold:g})")
    if report.floor is not None:
        f = report.floor
        print(
            f"  INFO floor      exact prefill in {f.dtype} vs float32: first-token KL "
            f"{f.kl:.4f}, top-1 {f.top1:.2f}, greedy agreement {f.agreement:.2f}; "
            f"reuse drift = {f.policy_kl_multiple:.1f}x {_short(f.dtype)} drift "
            f"(full reuse {f.full_reuse_kl_multiple:.1f}x)"
        )
    verdict = "PASS: reuse allowed" if report.passed else "FAIL: reuse refused"
    print(f"verdict: {verdict} ({report.wall_s:.1f} s)")


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def write_report(report: CheckReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--out", type=Path, default=Path("sgl_pic_check.json"), help="JSON report")
    p.add_argument("--policy", default=None, help="policy checked (default: the default's)")
    d = CheckThresholds()
    p.add_argument("--max-kl-ratio", type=float, default=d.max_kl_ratio)
    p.add_argument("--min-agreement", type=float, default=d.min_agreement)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = PicConfig() if args.policy is None else PicConfig(policy=args.policy)
        limits = CheckThresholds(
            max_kl_ratio=args.max_kl_ratio,
            min_agreement=args.min_agreement,
            new_tokens=args.new_tokens,
        )
    except ValueError as e:
        p.error(str(e))
    report = run_check(args.model, config, limits)
    print_report(report)
    write_report(report, args.out)
    print(f"wrote {args.out}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
