"""Can a request's drift be estimated from what its recompute pass sees?

Issue 46's second estimator study, oracle only (nothing here changes serving).
``bench/drift_estimate.py`` judged the signals the path has *before* it recomputes (the
probe's early-layer attention, CacheBlend's first-layer deviation): they rank budgets, not
requests within one budget. Phase 2 itself computes more, at no extra forward: every
layer's queries of the question, over the request's KV as it is at that layer (recomputed
rows fresh, the rest reused), and every layer's fresh K/V of the recomputed rows beside
the reused K/V they replace. Per MuSiQue example (prompts as ``bench/fidelity.py`` builds
them) and query_aware budget (``--ratios``):

* ``attention_reused`` / ``attention_reused_deep``: the question's attention on the chunk
  tokens left reused, as a share of its attention to the prompt, averaged over every layer
  / over the upper half (where ``bench/results/diagnosis.md`` finds 75% of the deviation);
* ``deviation_recomputed`` / ``deviation_recomputed_deep``: the relative K/V change of the
  recomputed chunk rows, ``(|dK| + |dV|) / (|K| + |V|)`` of the reused values, averaged
  over rows and layers: how stale this request's reused KV was where it was looked at;
* ``residual_deep``: the attention on reused tokens weighted by their chunk's mean change
  of the recomputed rows at that layer: the stale KV the question still reads;
* ``attended_change``: the change of the recomputed rows weighted by the question's
  attention to them;
* ``entropy`` / ``top1_margin``: the entropy of the served first-token distribution and
  the probability gap between its two most likely tokens (a near tie has more mass to
  move);
* ``distance_to_full_reuse``: first-token KL of this result to full reuse of the same
  chunks (``bench/drift_target.py``'s first estimator; it needs a second pass).

The truth is first-token KL to exact prefill. Log-linear fits on the first
``--fit-examples`` examples (``drift_estimate.fit``) are judged on the others by Spearman
rank correlation with true KL, within each budget (what a per-request target needs) and
over all pairs; each signal's own held-out correlation is reported beside them. The
entropy, the best of them, then drives ``bench/drift_target.py``'s budget ladder on the
held-out examples (a request moves up a budget while its estimate misses the target),
and ladders of one budget each (a request that misses goes to exact prefill), beside the
same ladders driven by the true KL.

    python bench/drift_after.py --first 0 --examples 20 --threads 1 --out a.json
    python bench/drift_after.py --first 20 --examples 20 --threads 1 --out b.json
    python bench/drift_after.py --merge a.json b.json --fit-examples 20
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import (  # noqa: E402
    add_data_option,
    add_model_option,
    add_out_option,
    git_state,
    load_oracle_model,
    percentile,
    write_json,
)
from drift_estimate import add_study_options, fit, judge, prepare, spearman  # noqa: E402
from drift_target import Fit, climb, fit_law  # noqa: E402

from sgl_pic.config import PicConfig  # noqa: E402
from sgl_pic.fidelity import first_token_kl  # noqa: E402
from sgl_pic.layout import PromptLayout  # noqa: E402
from sgl_pic.oracle import Oracle  # noqa: E402
from sgl_pic.oracle.forward import KVCache  # noqa: E402
from sgl_pic.prompts import load_rag_examples  # noqa: E402
from sgl_pic.selection import SelectionContext, finalize, make_policy  # noqa: E402
from sgl_pic.selection.cacheblend import reused_candidates  # noqa: E402
from sgl_pic.selection.query_aware import query_positions, question_attention  # noqa: E402

SIGNALS = (
    "attention_reused",
    "attention_reused_deep",
    "deviation_recomputed",
    "deviation_recomputed_deep",
    "residual_deep",
    "attended_change",
    "entropy",
    "top1_margin",
    "distance_to_full_reuse",
)
EPS = 1e-6
FIXED = "query_aware 0.15"  # the server's default budget, the fixed-ratio reference
TARGETS = (0.03, 0.05, 0.075, 0.1, 0.13)  # first-token KL targets of the ladder
# Targets of the one-rung ladders (a budget, then exact prefill): near the fixed budget's
# 90th percentile, where only the requests estimated worst would go to exact prefill.
TARGETS_TO_EXACT = (0.075, 0.1, 0.13, 0.16, 0.2, 0.25, 0.3)
# Candidate estimators: what a server could return without exact prefill. The last needs
# a second pass (full reuse); the others only the recompute pass's own tensors.
ESTIMATORS: dict[str, tuple[str, ...]] = {
    "residual_deep": ("residual_deep",),
    "attention_reused_deep": ("attention_reused_deep",),
    "change and attention": ("deviation_recomputed_deep", "attention_reused_deep"),
    "one pass, all": SIGNALS[:-1],
    "entropy": ("entropy",),
    "entropy and margin": ("entropy", "top1_margin"),
    "distance_to_full_reuse": ("distance_to_full_reuse",),
    "entropy and distance": ("entropy", "distance_to_full_reuse"),
    "all, with full reuse": SIGNALS,
}


def relative_change(
    new: KVCache,  # [num_layers, N, num_kv_heads, head_dim] each, after recomputation
    old: KVCache,  # the same, before (the assembled reused KV)
    rows: torch.Tensor,  # [r] int64 recomputed rows
) -> torch.Tensor:
    """# [num_layers, r] ``(|dK| + |dV|) / (|K| + |V|)`` of each row's old K/V per layer."""
    dk = (new.k[:, rows] - old.k[:, rows]).float().flatten(2).norm(dim=2)
    dv = (new.v[:, rows] - old.v[:, rows]).float().flatten(2).norm(dim=2)
    base = old.k[:, rows].float().flatten(2).norm(dim=2) + old.v[:, rows].float().flatten(2).norm(
        dim=2
    )
    return (dk + dv) / base.clamp_min(1e-12)


def after_signals(
    attention: torch.Tensor,  # [num_layers, N] question attention during the pass
    change: torch.Tensor,  # [num_layers, r] relative_change of the recomputed rows
    recomputed: torch.Tensor,  # [r] int64 recomputed chunk rows (sorted)
    reused: torch.Tensor,  # [k] int64 chunk rows left reused
    chunk_of: torch.Tensor,  # [N] int64 chunk index of every position, -1 outside chunks
    num_chunks: int,
) -> dict[str, float]:
    """The one-pass signals of the module doc for one request at one selection."""
    layers = attention.shape[0]
    deep = slice(layers // 2, layers)
    total = attention.sum(dim=1).clamp_min(1e-12)  # [L]
    share = attention[:, reused].sum(dim=1) / total  # [L]
    # Per layer, each chunk's mean change over its recomputed rows (0 where none were).
    sums = torch.zeros(layers, num_chunks + 1)
    counts = torch.zeros(num_chunks + 1)
    slot = chunk_of[recomputed].clamp_min(-1) + 1  # 0 collects rows outside chunks
    sums.index_add_(1, slot, change)
    counts.index_add_(0, slot, torch.ones(recomputed.numel()))
    mean_change = sums / counts.clamp_min(1)  # [L, C + 1]
    residual = (attention[:, reused] * mean_change[:, chunk_of[reused] + 1]).sum(dim=1) / total
    att_r = attention[:, recomputed]
    attended = (att_r * change).sum(dim=1) / att_r.sum(dim=1).clamp_min(1e-12)
    has = recomputed.numel() > 0
    return {
        "attention_reused": float(share.mean()),
        "attention_reused_deep": float(share[deep].mean()),
        "deviation_recomputed": float(change.mean()) if has else 0.0,
        "deviation_recomputed_deep": float(change[deep].mean()) if has else 0.0,
        "residual_deep": float(residual[deep].mean()),
        "attended_change": float(attended.mean()) if has else 0.0,
    }


def confidence(logits: torch.Tensor) -> dict[str, float]:  # logits: [vocab]
    """Entropy (nats) of the served next-token distribution and its top-1 minus top-2
    probability."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    top = logp.exp().topk(2).values
    return {"entropy": float(-(logp.exp() * logp).sum()), "top1_margin": float(top[0] - top[1])}


def chunk_index(layout: PromptLayout) -> torch.Tensor:
    """# [N] int64: each position's chunk index, -1 for fresh tokens."""
    out = torch.full((layout.num_tokens,), -1, dtype=torch.int64)
    for i, s in enumerate(layout.chunks):
        out[s.start : s.end] = i
    return out


def _scorer(
    seen: torch.Tensor,  # [num_layers, N] filled in, one row per layer
    rows: torch.Tensor,  # [q] rows of the question's queries among the computed tokens
    queries: torch.Tensor,  # [q] their positions
) -> Any:
    def score(layer: int, q: torch.Tensor, kv: KVCache) -> None:  # q: [n, H, D]
        seen[layer] = question_attention(q[rows], kv.k[layer], queries)

    return score


def run_example(
    oracle: Oracle, tokenizer: Any, ex: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    ids, layout, full, chunks, assembled, attention = prepare(oracle, tokenizer, ex, args)
    base = PicConfig()
    ctx = SelectionContext(
        layout=layout,
        rankings=tuple(c.ranking for c in chunks),
        deviation=lambda: oracle.first_layer_deviation(ids, layout, assembled),
        query_attention=lambda: attention,
    )
    candidates = reused_candidates(ctx)
    chunk_of = chunk_index(layout)
    queries = query_positions(layout)
    reuse_logits = oracle.recompute(
        ids,
        assembled,
        finalize(make_policy(base.with_overrides(policy="full_reuse")).select(ctx), layout),
    ).logits
    out = []
    for ratio in args.ratios:
        config = base.with_overrides(policy="query_aware", qa_ratio=ratio)
        chosen = finalize(make_policy(config).select(ctx), layout)
        rows = torch.searchsorted(chosen.indices, queries)
        seen = torch.zeros(oracle.w.num_layers, layout.num_tokens)

        res = oracle.recompute(ids, assembled, chosen, on_queries=_scorer(seen, rows, queries))
        recomputed = candidates[torch.isin(candidates, chosen.indices)]
        reused = candidates[~torch.isin(candidates, chosen.indices)]
        change = relative_change(res.kv, assembled, recomputed)
        out.append(
            {
                "config": f"query_aware {ratio:g}",
                "num_tokens": layout.num_tokens,
                "kl": first_token_kl(full.logits, res.logits),
                "recompute_fraction": recomputed.numel() / max(candidates.numel(), 1),
                "distance_to_full_reuse": first_token_kl(res.logits, reuse_logits),
                **confidence(res.logits),
                **after_signals(seen, change, recomputed, reused, chunk_of, len(layout.chunks)),
            }
        )
    return out


def within(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Spearman of one signal with true KL inside each config."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        sub = [r for r in rows if r["config"] == config]
        out[config] = spearman([r[key] for r in sub], [r["kl"] for r in sub])
    return out


def rung_fit(rows: list[dict[str, Any]], key: str) -> Fit:
    """``drift_target.fit_law`` of log KL on log(``key``) with one intercept per config."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    return fit_law(rows, configs, "config", lambda r: r[key] + EPS)


def ladder(
    rows: list[dict[str, Any]],
    estimate: Callable[[dict[str, Any]], float],
    target: float,
    config: str | None = None,
) -> dict[str, Any]:
    """``drift_target.climb`` over this study's rows: each example runs at its lowest
    budget and moves up while ``estimate`` misses ``target``, to exact prefill past the
    top (KL 0). With ``config``, the ladder has that budget alone: a request it misses
    goes straight to exact prefill."""
    by_example: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["recompute_fraction"]):
        if config is None or r["config"] == config:
            by_example.setdefault(r["example"], []).append(r)
    return climb(by_example.values(), estimate, target)


def _mean_fraction(rows: list[dict[str, Any]], config: str) -> float:
    return statistics.fmean(r["recompute_fraction"] for r in rows if r["config"] == config)


def to_exact_within(
    rows: list[dict[str, Any]],
    estimate: Callable[[dict[str, Any]], float],
    config: str,
    budget: float,
) -> dict[str, Any]:
    """One budget (``config``), then exact prefill for the requests ``estimate`` ranks
    worst, as many as keep the mean recomputed fraction of every rung tried at most
    ``budget``: the per-request target's best use of the fixed budget's compute, whatever
    target would pick them. KL mean and p90, the share sent to exact prefill."""
    base = sorted((r for r in rows if r["config"] == config), key=estimate, reverse=True)
    n = len(base)
    spent = sum(r["recompute_fraction"] for r in base)
    if spent / n > budget:
        raise ValueError(f"{config} alone recomputes {spent / n:.3f}, over {budget:.3f}")
    sent = 0
    while sent < n and (spent + 1.0) / n <= budget:
        spent += 1.0
        sent += 1
    kl = [0.0] * sent + [r["kl"] for r in base[sent:]]
    return {
        "config": config,
        "budget": budget,
        "to_exact": sent / n,
        "recompute_tried": spent / n,
        "kl_mean": statistics.fmean(kl),
        "kl_p90": percentile(kl, 0.9),
    }


def analyse(rows: list[dict[str, Any]], fit_examples: int, ridge: float) -> dict[str, Any]:
    """Fit each estimator on the first ``fit_examples`` examples, judge on the rest."""
    fitted = [r for r in rows if r["example"] < fit_examples]
    held = [r for r in rows if r["example"] >= fit_examples]
    if not fitted or not held:
        raise ValueError(f"need examples on both sides of {fit_examples}")
    out: dict[str, Any] = {"estimators": {}, "signals_held_out_within": {}}
    for name, features in ESTIMATORS.items():
        coef = fit(fitted, features, ridge)
        out["estimators"][name] = {
            "features": list(features),
            "coefficients": coef.tolist(),
            "fit": judge(fitted, coef, features),
            "held_out": judge(held, coef, features),
        }
    for key in SIGNALS:
        w = within(held, key)
        out["signals_held_out_within"][key] = {
            "per_config": w,
            "mean": statistics.fmean(w.values()),
        }
    # The ladder of bench/drift_target.py with the entropy as its estimate (one intercept
    # per budget), and with the true KL as the bound any estimator could reach.
    if all("recompute_fraction" in r for r in rows):
        intercepts, slope = rung_fit(fitted, "entropy")
        fixed = [r for r in held if r["config"] == FIXED]

        def by_entropy(r: dict[str, Any]) -> float:
            return math.exp(intercepts[r["config"]] + slope * math.log(r["entropy"] + EPS))

        def by_truth(r: dict[str, Any]) -> float:
            return float(r["kl"])

        estimates = (("entropy", by_entropy), ("true", by_truth))
        configs = list(dict.fromkeys(r["config"] for r in held))
        out["ladder"] = {
            "fixed": {
                "config": FIXED,
                "recompute": statistics.fmean(r["recompute_fraction"] for r in fixed),
                "kl_mean": statistics.fmean(r["kl"] for r in fixed),
                "kl_p90": percentile([r["kl"] for r in fixed], 0.9),
            },
            "entropy_fit": {"intercepts": intercepts, "slope": slope},
            "entropy": [ladder(held, by_entropy, t) for t in TARGETS],
            "true": [ladder(held, by_truth, t) for t in TARGETS],
            # One budget, then exact prefill: a rung between gains little (KL falls little
            # from 15% to 30%, RESULTS.md), exact prefill gains a request's whole KL.
            "to_exact": {
                config: {
                    name: [ladder(held, est, t, config) for t in TARGETS_TO_EXACT]
                    for name, est in estimates
                }
                for config in configs
            },
        }
        spend = out["ladder"]["fixed"]["recompute"]
        out["ladder"]["to_exact_at_fixed_compute"] = {
            config: {name: to_exact_within(held, est, config, spend) for name, est in estimates}
            for config in configs
            if _mean_fraction(held, config) < spend  # a rung that leaves room to send any
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(p, as_path=True)
    add_model_option(p)
    p.add_argument("--first", type=int, default=0, help="index of the first example")
    p.add_argument("--examples", type=int, default=40)
    p.add_argument(
        "--fit-examples", type=int, default=20, help="examples below N fit, the rest judge"
    )
    add_study_options(p)
    p.add_argument("--merge", type=Path, nargs="+", help="judge the rows of these runs together")
    add_out_option(p, "drift_after.json", as_path=True)
    args = p.parse_args(argv)
    if any(not 0 < r <= 1 for r in args.ratios):
        p.error("--ratios must be in (0, 1]")

    started = time.perf_counter()
    if args.merge:
        parts = [json.loads(f.read_text()) for f in args.merge]
        rows = [r for part in parts for r in part["rows"]]
        result = {k: v for k, v in parts[0].items() if k not in ("rows", "analysis")}
        # A merged file's own parts stay named (a re-analysis of an earlier merge).
        result["parts"] = [
            entry
            for f, part in zip(args.merge, parts, strict=True)
            for entry in part.get("parts") or [{"file": str(f), "commit": part["commit"]}]
        ]
        result["analysis_commit"] = git_state()._asdict()
        result["examples"] = len({r["example"] for r in rows})
    else:
        state = git_state()
        torch.set_num_threads(args.threads)
        model_path, tokenizer, oracle = load_oracle_model(args.model)
        examples = load_rag_examples(args.data)[args.first : args.first + args.examples]
        rows = []
        for i, ex in enumerate(tqdm(examples, desc="drift after", unit="example")):
            rows += [
                dict(r, example=args.first + i) for r in run_example(oracle, tokenizer, ex, args)
            ]
        result = {
            "benchmark": "drift_after",
            "issue": 46,
            "commit": state._asdict(),
            "model": str(model_path),
            "data": str(args.data),
            "first": args.first,
            "examples": len(examples),
            "ratios": args.ratios,
            "machine": platform.machine(),
            "torch": torch.__version__,
        }
    result["fit_examples"] = args.fit_examples
    exs = {r["example"] for r in rows}
    if min(exs) < args.fit_examples <= max(exs):
        result["analysis"] = analyse(rows, args.fit_examples, args.ridge)
        for name, e in result["analysis"]["estimators"].items():
            h = e["held_out"]
            print(
                f"{name:24s} held out: within a budget {h['spearman_within_config_mean']:+.3f} "
                + " ".join(f"{v:+.2f}" for v in h["spearman_within_config"].values())
                + f", all pairs {h['spearman_all']:+.3f}"
            )
        for key, s in result["analysis"]["signals_held_out_within"].items():
            print(f"  {key:26s} alone, held out within a budget {s['mean']:+.3f}")
        lad = result["analysis"].get("ladder")
        if lad is not None:
            f = lad["fixed"]
            print(
                f"fixed {f['config']}: recompute {f['recompute']:.3f}, KL mean "
                f"{f['kl_mean']:.4f}, p90 {f['kl_p90']:.4f}"
            )
            shapes = [("", name, lad[name]) for name in ("entropy", "true")] + [
                (f" {config} then exact,", name, runs[name])
                for config, runs in lad["to_exact"].items()
                for name in ("entropy", "true")
            ]
            for config, runs in lad["to_exact_at_fixed_compute"].items():
                for name, e in runs.items():
                    print(
                        f"  at the fixed budget's compute, {config} then exact by {name:7s}: "
                        f"{e['to_exact']:.3f} to exact, tried {e['recompute_tried']:.3f}, KL "
                        f"p90 {e['kl_p90']:.4f} ({e['kl_p90'] / f['kl_p90']:.2f} of fixed)"
                    )
            for shape, name, entries in shapes:
                for e in entries:
                    print(
                        f" {shape} ladder by {name:7s} target {e['target']:.3f}: met "
                        f"{e['met']:.2f}, recompute {e['recompute_served']:.3f} (tried "
                        f"{e['recompute_tried']:.3f}), KL p90 {e['kl_p90']:.4f}"
                    )
    result["wall_s"] = time.perf_counter() - started
    result["rows"] = rows
    write_json(args.out, result)
    print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
