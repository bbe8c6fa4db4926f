"""Can a per-request drift target be served? Estimators and a budget ladder, judged on a
fidelity run's rows.

``bench/fidelity.py`` records, for every query_aware result, its first-token KL to full
reuse of the same chunks and to query_aware at its other budgets (``kl_to``): quantities a
server could compute without exact prefill. This script, running no model, judges:

* estimators of each result's true first-token KL (a log-linear fit, one intercept per
  budget, on the first half of the examples): Spearman rank correlation with the truth on
  the other half, over all budgets and within one budget;
* a drift target served by a budget ladder: a request runs at the lowest budget, and
  moves up a rung while its estimate misses the target (exact prefill past the last rung).
  On the held-out half: the share of requests that meet the target, the mean recomputed
  fraction (of the rung served, and of every rung tried), and the 90th-percentile KL
  against the fixed budget's. The same ladder with the true KL as its estimate is the
  bound any estimator could reach.

    python bench/drift_target.py bench/results/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import add_out_option, git_state, percentile, write_json  # noqa: E402
from drift_estimate import spearman  # noqa: E402

EPS = 1e-6
# The ladder's rungs: query_aware at the default depth, lowest budget first.
LADDER = ("query_aware 5% L6", "query_aware 10% L6", "query_aware 15% L6", "query_aware 30% L6")
FIXED = "query_aware 15% L6"  # the server's default, the fixed-ratio reference
# Each estimator names, per rung, the result whose first-token distance it reads.
ESTIMATORS: dict[str, dict[str, str]] = {
    "to_full_reuse": {rung: "full_reuse" for rung in LADDER},
    "to_next_budget": {
        LADDER[0]: LADDER[1],
        LADDER[1]: LADDER[2],
        LADDER[2]: LADDER[3],
        LADDER[3]: LADDER[2],  # the top rung has none above: its neighbour below
    },
}


class Fit(NamedTuple):
    intercepts: dict[str, float]  # per rung
    slope: float  # on log(estimate signal)


def _signal(row: dict[str, Any], estimator: str) -> float:
    return float(row["kl_to"][ESTIMATORS[estimator][row["variant"]]]) + EPS


def fit(rows: list[dict[str, Any]], estimator: str) -> Fit:
    """Least squares of log KL on log(signal) with one intercept per rung."""
    return fit_law(rows, LADDER, "variant", lambda r: _signal(r, estimator))


def fit_law(
    rows: list[dict[str, Any]],
    rungs: Sequence[str],
    rung_key: str,
    signal: Callable[[dict[str, Any]], float],
) -> Fit:
    """Least squares of log KL on log(``signal(row)``) (positive), with one intercept per
    rung (``row[rung_key]``, one of ``rungs``)."""
    cols = [[1.0 if r[rung_key] == rung else 0.0 for r in rows] for rung in rungs]
    cols.append([math.log(signal(r)) for r in rows])
    x = torch.tensor(cols, dtype=torch.float64).T
    y = torch.tensor([math.log(r["kl"] + EPS) for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
    return Fit(dict(zip(rungs, coef[:-1], strict=True)), coef[-1])


def estimate(row: dict[str, Any], estimator: str, f: Fit) -> float:
    if estimator == "true":
        return float(row["kl"])
    return math.exp(f.intercepts[row["variant"]] + f.slope * math.log(_signal(row, estimator)))


def judge(rows: list[dict[str, Any]], estimator: str, f: Fit) -> dict[str, Any]:
    est = [estimate(r, estimator, f) for r in rows]
    kl = [r["kl"] for r in rows]
    within = {
        rung: spearman(
            [e for e, r in zip(est, rows, strict=True) if r["variant"] == rung],
            [r["kl"] for r in rows if r["variant"] == rung],
        )
        for rung in LADDER
    }
    return {
        "spearman_all": spearman(est, kl),
        "spearman_within_budget": within,
        "spearman_within_budget_mean": statistics.fmean(within.values()),
    }


def ladder(
    by_example: dict[int, dict[str, dict[str, Any]]], estimator: str, f: Fit, target: float
) -> dict[str, Any]:
    """Every example climbs the ladder until its estimate is at most ``target``."""
    return climb(
        ([rows[rung] for rung in LADDER] for rows in by_example.values()),
        lambda row: estimate(row, estimator, f),
        target,
    )


def climb(
    rungs_by_example: Iterable[Sequence[dict[str, Any]]],
    estimate_of: Callable[[dict[str, Any]], float],
    target: float,
) -> dict[str, Any]:
    """A drift target served by a budget ladder: each example's rungs (lowest budget first)
    are tried in turn until ``estimate_of(row)`` is at most ``target``; past the last,
    exact prefill (KL 0, all recomputed). Share of examples that meet the target, mean
    recomputed fraction of the rung served and of every rung tried, KL mean and p90."""
    served_kl, served_frac, tried_frac = [], [], []
    for rows in rungs_by_example:
        tried = 0.0
        for row in rows:
            tried += row["recompute_fraction"]
            if estimate_of(row) <= target:
                served_kl.append(row["kl"])
                served_frac.append(row["recompute_fraction"])
                break
        else:  # no rung meets it: exact prefill
            tried += 1.0
            served_kl.append(0.0)
            served_frac.append(1.0)
        tried_frac.append(tried)
    return {
        "target": target,
        "met": statistics.fmean(k <= target for k in served_kl),
        "recompute_served": statistics.fmean(served_frac),
        "recompute_tried": statistics.fmean(tried_frac),
        "kl_mean": statistics.fmean(served_kl),
        "kl_p90": percentile(served_kl, 0.9),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fidelity", type=Path, help="a fidelity.json with kl_to in its rows")
    p.add_argument("--fit-examples", type=int, default=20, help="the first N examples fit")
    add_out_option(p, "drift_target.json", as_path=True)
    args = p.parse_args(argv)
    source = json.loads(args.fidelity.read_text())
    rows = [r for r in source["rows"] if r["variant"] in (*LADDER, "full_reuse")]
    if not rows or any(r.get("kl_to") is None for r in rows if r["variant"] in LADDER):
        p.error(f"{args.fidelity} has no kl_to on its query_aware rows (an older run)")
    examples = sorted({r["example"] for r in rows})
    fit_ids = set(examples[: args.fit_examples])
    ladder_rows = [r for r in rows if r["variant"] in LADDER]
    train = [r for r in ladder_rows if r["example"] in fit_ids]
    held = [r for r in ladder_rows if r["example"] not in fit_ids]
    if not train or not held:
        p.error("--fit-examples leaves no examples to fit or none held out")
    by_example: dict[int, dict[str, dict[str, Any]]] = {}
    for r in held:
        by_example.setdefault(r["example"], {})[r["variant"]] = r
    fixed = [rows_[FIXED] for rows_ in by_example.values()]
    result: dict[str, Any] = {
        "benchmark": "drift_target",
        "commit": git_state()._asdict(),
        "source": str(args.fidelity),
        "source_commit": source.get("commit"),
        "fit_examples": len(fit_ids),
        "held_out_examples": len(by_example),
        "fixed": {
            "variant": FIXED,
            "recompute": statistics.fmean(r["recompute_fraction"] for r in fixed),
            "kl_mean": statistics.fmean(r["kl"] for r in fixed),
            "kl_p90": percentile([r["kl"] for r in fixed], 0.9),
        },
        "estimators": {},
    }
    targets = sorted({round(10 ** (e / 8), 5) for e in range(-24, 1)})  # 1e-3 .. 1
    for name in (*ESTIMATORS, "true"):
        f = Fit({}, 0.0) if name == "true" else fit(train, name)
        entry: dict[str, Any] = {"fit": f._asdict()}
        if name != "true":
            entry["fitted"] = judge(train, name, f)
            entry["held_out"] = judge(held, name, f)
        entry["ladder"] = [ladder(by_example, name, f, t) for t in targets]
        result["estimators"][name] = entry
    write_json(args.out, result)
    print(
        f"fixed {FIXED}: recompute {result['fixed']['recompute']:.3f}, KL mean "
        f"{result['fixed']['kl_mean']:.4f}, p90 {result['fixed']['kl_p90']:.4f} "
        f"({len(by_example)} held-out examples)"
    )
    for name, entry in result["estimators"].items():
        if "held_out" in entry:
            h = entry["held_out"]
            print(
                f"\n{name}: held-out Spearman all {h['spearman_all']:.2f}, within a budget "
                f"{h['spearman_within_budget_mean']:.2f} "
                + str({k[12:]: round(v, 2) for k, v in h["spearman_within_budget"].items()})
            )
        else:
            print(f"\n{name} (the bound: the true KL as the estimate)")
        print(f"{'target':>8}{'met':>6}{'recomp':>8}{'tried':>8}{'KL mean':>9}{'KL p90':>8}")
        for lad in entry["ladder"]:
            print(
                f"{lad['target']:>8.4f}{lad['met']:>6.2f}{lad['recompute_served']:>8.3f}"
                f"{lad['recompute_tried']:>8.3f}{lad['kl_mean']:>9.4f}{lad['kl_p90']:>8.4f}"
            )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
