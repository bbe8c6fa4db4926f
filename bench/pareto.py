"""Pareto plots of fidelity against cost, from committed results (no model is run).

    python bench/pareto.py [--fidelity bench/results/fidelity.json]
                           [--serve bench/results/serve.json]

Left: first-token KL against the fraction of chunk tokens recomputed, every variant of
``fidelity.json`` with its 95% bootstrap interval. Right: the same KL of each policy at its
default budget against its TTFT through the server over full prefill's in the same run
(``serve.json``, paired median per request). The two runs use the same prompt shape
(``serve.py --passages 8 --passage-tokens 256``), not the same examples: the right plot
pairs means, not requests. Writes pareto.png and pareto.json beside the fidelity results.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from _common import RESULTS, write_json

from sgl_pic.fidelity import paired_ratio_ci

ORACLE = "oracle_selection"


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (lower is better on both), by x."""
    best: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not best or y < best[-1][1]:
            best.append((x, y))
    return best


def target(fidelity: dict[str, Any], budget: float = 0.15, seed: int = 0) -> list[dict[str, Any]]:
    """Issue #11's measure for every variant at no more than ``budget`` recomputed: its mean
    first-token KL over full reuse's, with a paired 95% bootstrap interval (examples
    resampled, both means taken on the same resample), and its greedy agreement; where the
    run has them (issue 46), its teacher-forced top-1 less the bfloat16 floor's and its
    first-token KL as a multiple of the floor's."""
    rows = fidelity["rows"]
    reuse = {r["example"]: r["kl"] for r in rows if r["variant"] == "full_reuse"}
    examples = sorted(reuse)
    den = [reuse[e] for e in examples]
    floor = next((s for s in fidelity["summary"] if s["policy"] == "exact_bfloat16"), None)
    out = []
    for s in fidelity["summary"]:
        if s["recompute_fraction"] > budget + 1e-3 or s["variant"] == "full_reuse":
            continue
        kl = {r["example"]: r["kl"] for r in rows if r["variant"] == s["variant"]}
        # The same resamples for every variant (one seed).
        ci = paired_ratio_ci([kl[e] for e in examples], den, seed)
        out.append(
            {
                "variant": s["variant"],
                "recompute_fraction": s["recompute_fraction"],
                "kl_over_full_reuse": s["kl"] / statistics.fmean(reuse.values()),
                "kl_over_full_reuse_ci95": ci,
                "greedy_agreement": s["greedy_agreement"],
                "greedy_agreement_ci95": s["greedy_agreement_ci95"],
            }
        )
        if floor is not None and "tf_top1" in s:
            out[-1]["tf_top1_minus_bfloat16"] = s["tf_top1"] - floor["tf_top1"]
            out[-1]["kl_over_bfloat16"] = s.get("kl_over_bfloat16")
    return sorted(out, key=lambda t: t["kl_over_full_reuse"])


def collect(fidelity: dict[str, Any], serve: dict[str, Any] | None) -> dict[str, Any]:
    by_fraction = [
        {
            "variant": s["variant"],
            "policy": s["policy"],
            "recompute_fraction": s["recompute_fraction"],
            "kl": s["kl"],
            "kl_ci95": s["kl_ci95"],
        }
        for s in fidelity["summary"]
        if not s.get("floor")  # a precision floor has no budget: a level, not a point
    ]
    floors = [
        {"variant": s["variant"], "kl": s["kl"], "kl_ci95": s["kl_ci95"]}
        for s in fidelity["summary"]
        if s.get("floor")
    ]
    by_ttft = []
    if serve is not None:
        defaults = {s["policy"]: s for s in fidelity["summary"] if s["default"]}
        for policy, speedup in serve["speedup_paired_median"].items():
            if policy in defaults:
                by_ttft.append(
                    {
                        "policy": policy,
                        "ttft_over_full_prefill": 1.0 / speedup,
                        "kl": defaults[policy]["kl"],
                        "kl_ci95": defaults[policy]["kl_ci95"],
                        "selection_share_mean": serve.get("selection_share_mean", {}).get(policy),
                    }
                )
    return {
        "fidelity_commit": fidelity.get("commit"),
        "serve_commit": None if serve is None else serve.get("git_commit"),
        "by_fraction": by_fraction,
        "floors": floors,
        # The oracle selection needs a full prefill to choose: a bound, not a policy.
        "frontier_by_fraction": frontier(
            [(p["recompute_fraction"], p["kl"]) for p in by_fraction if p["policy"] != ORACLE]
        ),
        "at_15_percent": target(fidelity),
        "by_ttft": by_ttft,
        "frontier_by_ttft": frontier([(p["ttft_over_full_prefill"], p["kl"]) for p in by_ttft]),
    }


def plot(points: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    policies = sorted({p["policy"] for p in points["by_fraction"]})
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    for ax, key, rows in (
        (axes[0], "recompute_fraction", points["by_fraction"]),
        (axes[1], "ttft_over_full_prefill", points["by_ttft"]),
    ):
        for p in rows:
            lo, hi = p["kl_ci95"]
            ax.errorbar(
                p[key],
                p["kl"],
                yerr=[[p["kl"] - lo], [hi - p["kl"]]],
                fmt="o",
                color=colors[p["policy"]],
                capsize=2,
                label=p["policy"],
            )
        front = points["frontier_by_" + ("fraction" if key == "recompute_fraction" else "ttft")]
        if front:
            xs, ys = zip(*front, strict=True)
            ax.plot(xs, ys, "k--", lw=0.8, label="Pareto frontier")
        for floor in points.get("floors", []):
            ax.axhline(floor["kl"], ls=":", color="k", lw=0.8)
            ax.text(ax.get_xlim()[0], floor["kl"], f" {floor['variant']}", fontsize=7)
        ax.set_ylabel("first-token KL to full prefill (nats)")
        ax.set_yscale("symlog", linthresh=1e-2)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    axes[0].set_xlabel("fraction of chunk tokens recomputed (oracle, every variant)")
    axes[1].set_xlabel("TTFT / full prefill TTFT through the server (default budgets)")
    fig.suptitle("Fidelity against cost (SmolLM2-135M, MuSiQue, 95% bootstrap intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fidelity", type=Path, default=RESULTS / "fidelity.json")
    p.add_argument("--serve", type=Path, default=RESULTS / "serve.json")
    p.add_argument("--out", type=Path, default=RESULTS / "pareto.json")
    args = p.parse_args(argv)
    fidelity = json.loads(args.fidelity.read_text())
    serve = json.loads(args.serve.read_text()) if args.serve.exists() else None
    points = collect(fidelity, serve)
    write_json(args.out, points)
    plot(points, args.out.with_suffix(".png"))
    for t in points["at_15_percent"]:
        lo, hi = t["kl_over_full_reuse_ci95"]
        print(
            f"{t['variant']:<34} recomputed {t['recompute_fraction']:.3f}  KL / full reuse "
            f"{t['kl_over_full_reuse']:.3f} [{lo:.3f}, {hi:.3f}]  greedy agreement "
            f"{t['greedy_agreement']:.2f}"
        )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
