"""Can a request's drift be estimated from what the reuse path already computes?

Issue 46's estimator study, oracle only (nothing here changes serving). Per MuSiQue
example (prompts as ``bench/fidelity.py`` builds them) and per query_aware budget
(``--ratios``, plus full reuse), the signals the path has before it recomputes:

* the probe's early-layer attention of the question (``query_attention``, the signal
  query_aware ranks by) on the tokens left reused after the selection, as a share of
  the question's attention to the whole prompt; the same share on the chunks' first
  tokens (the sinks of their independent encoding) left reused;
* CacheBlend's first-layer deviation (``first_layer_deviation``), averaged over the
  tokens left reused, and weighted by the probe's attention to them;
* the fraction of reusable tokens left reused;

and the truth: first-token KL of the reused path to full prefill. A linear model of
log KL on the logs of the signals is fitted by least squares on the first
``--fit-examples`` examples and judged on the others by the Spearman rank correlation of
estimate and true KL: over every held-out (example, budget) pair, and within each budget
(which requests of one budget drift most: what a per-request target needs). Each
signal's own rank correlation is reported beside it.

    python bench/drift_estimate.py --examples 40 --fit-examples 20
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import (  # noqa: E402
    add_data_option,
    add_model_option,
    add_out_option,
    git_state,
    load_oracle_model,
    write_json,
)

from sgl_pic.config import PicConfig  # noqa: E402
from sgl_pic.fidelity import first_token_kl  # noqa: E402
from sgl_pic.layout import PromptLayout  # noqa: E402
from sgl_pic.oracle import Oracle  # noqa: E402
from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens  # noqa: E402
from sgl_pic.selection import SelectionContext, finalize, make_policy  # noqa: E402
from sgl_pic.selection.cacheblend import reused_candidates  # noqa: E402

FEATURES = (
    "attention_reused",
    "attention_sinks_reused",
    "deviation",
    "deviation_x_attention",
    "reused_fraction",
)
EPS = 1e-6


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equal-length lists (ties broken by order); nan if either
    is constant or shorter than 3."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} values")
    if len(a) < 3:
        return float("nan")
    ra = torch.tensor(a).argsort().argsort().to(torch.float64)
    rb = torch.tensor(b).argsort().argsort().to(torch.float64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = ra.norm() * rb.norm()
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def signals(
    attention: torch.Tensor,  # [N] the probe's question attention (query_attention)
    deviation: torch.Tensor,  # [N] first-layer deviation of the assembled KV
    layout: PromptLayout,
    reused: torch.Tensor,  # [k] indices of reusable tokens the selection leaves reused
    reusable: int,
) -> dict[str, float]:
    """The estimator's inputs for one request at one selection (see the module doc)."""
    total = float(attention.sum()) or 1.0
    firsts = torch.tensor([s.start for s in layout.chunks], dtype=torch.int64)
    sinks = reused[torch.isin(reused, firsts)]
    att, dev = attention[reused], deviation[reused]
    return {
        "attention_reused": float(att.sum()) / total,
        "attention_sinks_reused": float(attention[sinks].sum()) / total,
        "deviation": float(dev.mean()) if reused.numel() else 0.0,
        "deviation_x_attention": float((att * dev).sum()) / total,
        "reused_fraction": reused.numel() / max(reusable, 1),
    }


class Prepared(NamedTuple):
    """One MuSiQue example as the studies run it: its prompt, exact prefill, independently
    encoded chunks assembled at their places, and the probe's question attention at the
    default's layers (one per request: the selection does not change it)."""

    ids: torch.Tensor  # [N]
    layout: PromptLayout
    full: Any  # Oracle.prefill's FullPrefill
    chunks: list[Any]  # ChunkKV per chunk span
    assembled: Any  # KVCache, [num_layers, N, num_kv_heads, head_dim] each
    attention: torch.Tensor  # [N]


def prepare(oracle: Oracle, tokenizer: Any, ex: Any, args: argparse.Namespace) -> Prepared:
    """The prompt of ``bench/fidelity.py`` (``args.passages`` passages of at most
    ``args.passage_tokens`` tokens) for ``ex``, and what every budget shares."""
    passages = [truncate_tokens(tokenizer, p, args.passage_tokens) for p in ex.passages]
    prompt = build_prompt(tokenizer, passages[: args.passages], ex.question)
    ids, layout = prompt.token_ids, prompt.layout
    full = oracle.prefill(ids)
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    assembled = oracle.assemble(ids, layout, chunks)
    attention = oracle.query_attention(ids, layout, assembled, PicConfig().qa_layers)
    return Prepared(ids, layout, full, chunks, assembled, attention)


def run_example(
    oracle: Oracle, tokenizer: Any, ex: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    ids, layout, full, chunks, assembled, attention = prepare(oracle, tokenizer, ex, args)
    base = PicConfig()
    # One deviation per request: the selection does not change it.
    deviation = oracle.first_layer_deviation(ids, layout, assembled)
    ctx = SelectionContext(
        layout=layout,
        rankings=tuple(c.ranking for c in chunks),
        deviation=lambda: deviation,
        query_attention=lambda: attention,
    )
    candidates = reused_candidates(ctx)
    out = []
    configs = [("full_reuse", base.with_overrides(policy="full_reuse"))] + [
        (f"query_aware {r:g}", base.with_overrides(policy="query_aware", qa_ratio=r))
        for r in args.ratios
    ]
    for label, config in configs:
        chosen = finalize(make_policy(config).select(ctx), layout)
        reused = candidates[~torch.isin(candidates, chosen.indices)]
        res = oracle.recompute(ids, assembled, chosen)
        out.append(
            {
                "config": label,
                "num_tokens": layout.num_tokens,
                "kl": first_token_kl(full.logits, res.logits),
                **signals(attention, deviation, layout, reused, layout.num_reusable),
            }
        )
    return out


def design(rows: list[dict[str, Any]], features: tuple[str, ...]) -> torch.Tensor:
    """# [len(rows), 1 + len(features)]: an intercept and the log of each signal."""
    cols = [[1.0] * len(rows)] + [
        [float(torch.tensor(r[f] + EPS).log()) for r in rows] for f in features
    ]
    return torch.tensor(cols, dtype=torch.float64).T


def fit(rows: list[dict[str, Any]], features: tuple[str, ...], ridge: float) -> torch.Tensor:
    """# [1 + len(features)] least-squares (ridge-regularised) coefficients of log KL."""
    x = design(rows, features)
    y = torch.tensor([r["kl"] + EPS for r in rows], dtype=torch.float64).log()
    reg = ridge * torch.eye(x.shape[1], dtype=torch.float64)
    reg[0, 0] = 0.0  # the intercept is not shrunk
    return torch.linalg.solve(x.T @ x + reg, x.T @ y)


def judge(
    rows: list[dict[str, Any]], coef: torch.Tensor, features: tuple[str, ...]
) -> dict[str, Any]:
    """Spearman of the estimate with true KL: over all rows, and within each config."""
    est = (design(rows, features) @ coef).exp().tolist()
    kl = [r["kl"] for r in rows]
    within = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["config"] == config]
        within[config] = spearman([est[i] for i in idx], [kl[i] for i in idx])
    finite = [v for v in within.values() if v == v]
    return {
        "spearman_all": spearman(est, kl),
        "spearman_within_config": within,
        "spearman_within_config_mean": statistics.fmean(finite) if finite else float("nan"),
        "signal_spearman_all": {f: spearman([r[f] for r in rows], kl) for f in features},
    }


def add_study_options(p: argparse.ArgumentParser) -> None:
    """The prompts, budgets and fit of a drift study (this script's and drift_after's)."""
    p.add_argument("--passages", type=int, default=8)
    p.add_argument("--passage-tokens", type=int, default=256)
    p.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.05, 0.1, 0.15, 0.3],
        help="query_aware budgets (fractions of the reused tokens)",
    )
    p.add_argument("--ridge", type=float, default=1e-3, help="L2 penalty of the fits")
    p.add_argument("--threads", type=int, default=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(p, as_path=True)
    add_model_option(p)
    p.add_argument("--examples", type=int, default=40)
    p.add_argument("--fit-examples", type=int, default=20, help="the first N fit, the rest judge")
    add_study_options(p)
    add_out_option(p, "drift_estimate.json", as_path=True)
    args = p.parse_args(argv)
    if not 1 <= args.fit_examples < args.examples:
        p.error("need 1 <= --fit-examples < --examples: some examples must be held out")
    if any(not 0 < r <= 1 for r in args.ratios):
        p.error("--ratios must be in (0, 1]")

    started = time.perf_counter()
    state = git_state()  # the code that runs is the tree's now, whatever HEAD is at the end
    torch.set_num_threads(args.threads)
    model_path, tokenizer, oracle = load_oracle_model(args.model)
    examples = load_rag_examples(args.data)[: args.examples]
    rows = []
    for i, ex in enumerate(tqdm(examples, desc="drift estimate", unit="example")):
        rows += [dict(r, example=i) for r in run_example(oracle, tokenizer, ex, args)]
    fitted = [r for r in rows if r["example"] < args.fit_examples]
    held = [r for r in rows if r["example"] >= args.fit_examples]
    coef = fit(fitted, FEATURES, args.ridge)
    result = {
        "benchmark": "drift_estimate",
        "issue": 46,
        "commit": state._asdict(),
        "model": str(model_path),
        "data": str(args.data),
        "examples": len(examples),
        "fit_examples": args.fit_examples,
        "ratios": args.ratios,
        "features": list(FEATURES),
        "coefficients": dict(zip(("intercept", *FEATURES), coef.tolist(), strict=True)),
        "fit": judge(fitted, coef, FEATURES),
        "held_out": judge(held, coef, FEATURES),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    write_json(args.out, result)
    for part in ("fit", "held_out"):
        j = result[part]
        print(
            f"{part}: Spearman(estimate, KL) {j['spearman_all']:+.3f} over all pairs, "
            f"{j['spearman_within_config_mean']:+.3f} within a budget (mean)"
        )
        print(
            "  signals alone: "
            + ", ".join(f"{k} {v:+.3f}" for k, v in j["signal_spearman_all"].items())
        )
    print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
