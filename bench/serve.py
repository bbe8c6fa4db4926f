"""TTFT through a running sgl_pic server: full prefill vs every policy, measured in one run.

    python -m sgl_pic.launch_server --port 30000 &
    python bench/serve.py --url http://127.0.0.1:30000 --examples 6
    # or let it launch (and end) its own server:
    python bench/serve.py --launch --examples 6 [--server-args "--device cuda ..."]
    # (--launch gives the server a temporary disk tier unless --server-args names one)

For each MuSiQue example (its first --passages passages; prompts must stay under SGLang's
--chunked-prefill-size, 4096 by default, or they run without reuse) the chunks are warmed
once (a chunked request under full_recompute), then one request per measurement with
max_new_tokens=1: a plain request for full prefill, a chunked one with the policy override
for each policy. TTFT is the client-side latency of that request. Ratios are full-prefill
TTFT over policy TTFT from the same run. Results go to bench/results/serve.json (--out).

Each request (the warm-up too) starts with a short unique header, tokenized on its own and
outside every chunk, so it misses SGLang's prefix tree without /flush_cache: a flush would
also drop the chunk nodes (the device tier) and turn the hits into host-memory ones. The
chunked measurements must then be served from the device tier: from /metrics, each adds
sgl_pic_tier_hits_total{tier="device"} equal to its chunk count and no miss, failure or
fallback; SGLang's cached_tokens must stay inside the header. The result is "tier_check"
in the JSON; the script exits with status 1 (after writing its results) if it fails.
bench/tiers.py measures the host and disk tiers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from _common import (
    RESULTS,
    add_data_option,
    add_out_option,
    add_server_args_option,
    embedded_tokenizer,
    git_state,
    write_json,
)
from _server import Client, delta, fresh_header, launch, metric, shifted

from sgl_pic.registry import POLICIES as REGISTRY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--launch", action="store_true", help="launch a server (ignores --url)")
    add_server_args_option(ap, help="extra server flags with --launch")
    add_data_option(ap, as_path=True)
    ap.add_argument("--examples", type=int, default=8)
    # MuSiQue passages are ~600 tokens with this tokenizer: 10 passages cut to 280 tokens
    # make a ~3k-token prompt (SGLang's --chunked-prefill-size is 4096 by default).
    ap.add_argument("--passages", type=int, default=10, help="passages (chunks) per prompt")
    ap.add_argument("--passage-tokens", type=int, default=280, help="truncate passages (0: no)")
    ap.add_argument("--policies", default="", help="comma-separated (default: every policy)")
    add_out_option(ap, "serve.json")
    ap.add_argument(
        "--baseline",
        default=str(RESULTS / "serve.json"),
        help="an earlier serve.json to compare mean TTFTs with (read before --out is written)",
    )
    args = ap.parse_args()
    policies = args.policies.split(",") if args.policies else REGISTRY.names()
    for p in policies:
        REGISTRY.get(p)  # an unknown name fails here, before any server starts
    baseline = _load(args.baseline)
    commit, dirty = git_state()

    from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens

    tok = embedded_tokenizer()
    examples = [ex for ex in load_rag_examples(args.data) if len(ex.passages) >= args.passages][
        : args.examples
    ]
    if not examples:
        raise SystemExit(f"no example has {args.passages} passages")
    sampling = {"temperature": 0, "max_new_tokens": 1}
    ttft: dict[str, list[float]] = {"full_prefill": [], **{p: [] for p in policies}}
    per_policy: dict[str, dict[str, float]] = {}
    records: list[dict[str, Any]] = []
    lengths = []
    check: dict[str, Any] = {
        "chunked_requests": 0,
        "chunks": 0,
        "device_hits": 0,
        "host_hits": 0,
        "disk_hits": 0,
        "misses": 0,
        "failures": 0,
        "fallbacks": 0,
        "max_cached_tokens": 0,
        "max_header_tokens": 0,
        "failed_requests": [],
    }
    with ExitStack() as stack:
        if args.launch:
            server_args = shlex.split(args.server_args)
            if not any(a.startswith("--pic-disk-cache-dir") for a in server_args):
                # A private disk tier: nothing from earlier runs, nothing left in ~/.cache.
                disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="sgl_pic_serve_"))
                server_args += ["--pic-disk-cache-dir", disk]
            client = stack.enter_context(launch(server_args))
        else:
            client = Client(args.url)
        for i, ex in enumerate(examples):
            passages = [truncate_tokens(tok, p, args.passage_tokens) for p in ex.passages]
            prompt = build_prompt(tok, passages[: args.passages], ex.question)
            ids = prompt.token_ids.tolist()
            spans = [[s.start, s.end] for s in prompt.layout.chunks]
            lengths.append(len(ids))

            def body(policy: str | None, ids: list[int] = ids, spans: list = spans) -> dict:
                # A fresh header per request: no prefix-tree hit, no flush needed.
                head = fresh_header(tok)
                out: dict[str, Any] = {"input_ids": head + ids, "sampling_params": sampling}
                if policy is not None:
                    pic = {"chunks": shifted(spans, len(head)), "config": {"policy": policy}}
                    out["pic"] = pic
                return out

            client.generate(body("full_recompute"))  # warm the chunk nodes
            ttft["full_prefill"].append(client.generate(body(None))[0])
            for policy in policies:
                req = body(policy)
                header = len(req["input_ids"]) - len(ids)
                before = client.metrics()
                dt, resp = client.generate(req)
                d = delta(before, client.metrics())
                ttft[policy].append(dt)
                records.append(
                    {
                        "example": i,
                        "policy": policy,
                        "prompt_tokens": len(ids),
                        "ttft_s": dt,
                        "full_prefill_ttft_s": ttft["full_prefill"][-1],
                        "speedup": ttft["full_prefill"][-1] / dt,
                        "recomputed_tokens": int(metric(d, "sgl_pic_recomputed_tokens_total")),
                        "phase2_runs": int(metric(d, "sgl_pic_phase2_runs_total")),
                        # The policy's selection, its signal passes (CacheBlend's deviation,
                        # the query probe) included, as the scheduler timed it.
                        "selection_s": metric(d, "sgl_pic_selection_seconds_sum"),
                        "selection_share": metric(d, "sgl_pic_selection_seconds_sum") / dt,
                    }
                )
                acc = per_policy.setdefault(policy, {})
                for k, v in d.items():
                    acc[k] = acc.get(k, 0.0) + v
                cached = int(resp.get("meta_info", {}).get("cached_tokens", 0))
                got = {
                    t: int(metric(d, "sgl_pic_tier_hits_total", tier=t))
                    for t in ("device", "host", "disk")
                }
                bad = {
                    "misses": int(metric(d, "sgl_pic_chunk_misses_total")),
                    "failures": int(metric(d, "sgl_pic_failures_total")),
                    "fallbacks": int(metric(d, "sgl_pic_fallbacks_total")),
                }
                check["chunked_requests"] += 1
                check["chunks"] += len(spans)
                for t, n in got.items():
                    check[f"{t}_hits"] += n
                for k, n in bad.items():
                    check[k] += n
                check["max_cached_tokens"] = max(check["max_cached_tokens"], cached)
                check["max_header_tokens"] = max(check["max_header_tokens"], header)
                if got["device"] != len(spans) or any(bad.values()) or cached >= header:
                    check["failed_requests"].append(
                        {
                            "example": i,
                            "policy": policy,
                            "chunks": len(spans),
                            "cached": cached,
                            **{f"{t}_hits": n for t, n in got.items()},
                            **bad,
                        }
                    )
            print(
                f"example {i + 1}/{len(examples)}: {len(ids)} tokens, full prefill "
                f"{ttft['full_prefill'][-1]:.2f} s, "
                + ", ".join(f"{p} {ttft[p][-1]:.2f} s" for p in policies),
                flush=True,
            )
    check["ok"] = not check["failed_requests"] and check["chunked_requests"] > 0

    base = statistics.mean(ttft["full_prefill"])
    report: dict[str, Any] = {
        "git_commit": commit,
        "git_dirty": dirty,
        "examples": len(examples),
        "passages": args.passages,
        "passage_tokens": args.passage_tokens,
        "mean_prompt_tokens": statistics.mean(lengths),
        "ttft_mean_s": {k: statistics.mean(v) for k, v in ttft.items()},
        "speedup_vs_full_prefill": {p: base / statistics.mean(ttft[p]) for p in policies},
        # Paired per request: each example's full prefill over its own policy request.
        "speedup_paired_median": {
            p: statistics.median(r["speedup"] for r in records if r["policy"] == p)
            for p in policies
        },
        "phase2_runs_mean": {
            p: statistics.mean(r["phase2_runs"] for r in records if r["policy"] == p)
            for p in policies
        },
        "selection_share_mean": {
            p: statistics.mean(r["selection_share"] for r in records if r["policy"] == p)
            for p in policies
        },
        "selection_share_max": {
            p: max(r["selection_share"] for r in records if r["policy"] == p) for p in policies
        },
        "hit_rate": {},
        "recomputed_fraction": {},
        "tier_check": check,
        "baseline": _compare(baseline, {k: statistics.mean(v) for k, v in ttft.items()}),
        "requests": records,
    }
    for p, m in per_policy.items():
        lookups = m.get("sgl_pic_chunk_lookups_total", 0.0)
        hits = sum(v for k, v in m.items() if k.startswith("sgl_pic_chunk_hits_total"))
        hits += m.get("sgl_pic_chunk_device_prefix_total", 0.0)
        new = m.get("sgl_pic_new_tokens_total", 0.0)
        report["hit_rate"][p] = hits / lookups if lookups else None
        report["recomputed_fraction"][p] = (
            m.get("sgl_pic_recomputed_tokens_total", 0.0) / new if new else None
        )
    write_json(args.out, report, indent=2, newline=True)
    print(json.dumps(report, indent=2))
    _plot(report, Path(args.out).with_suffix(".png"))
    if not check["ok"]:
        sys.exit(
            f"tier check failed: chunked measurements not all served from the device tier "
            f"({len(check['failed_requests'])} request(s); see tier_check in {args.out})"
        )


def _load(path: str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _compare(baseline: dict[str, Any] | None, ttft: dict[str, float]) -> dict[str, Any] | None:
    """Mean TTFT of this run over the baseline's (> 1: slower now), per measurement. Runs
    on a shared machine differ by load, so the in-run paired ratios are the measure; this
    only says whether the absolute times moved."""
    if baseline is None:
        return None
    old = baseline.get("ttft_mean_s", {})
    return {
        "git_commit": baseline.get("git_commit"),
        "ttft_ratio_now_over_baseline": {k: v / old[k] for k, v in ttft.items() if old.get(k)},
        "speedup_vs_full_prefill": baseline.get("speedup_vs_full_prefill"),
    }


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["ttft_mean_s"])
    ttft = [report["ttft_mean_s"][n] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bars = ax.bar(names, ttft)
    for bar, name in zip(bars, names, strict=True):
        ratio = report["speedup_vs_full_prefill"].get(name)
        label = "1.00x" if ratio is None else f"{ratio:.2f}x"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center")
    ax.set_ylabel("TTFT (s), mean over examples")
    ax.set_title(
        f"TTFT through the server, {report['examples']} MuSiQue prompts of "
        f"~{report['mean_prompt_tokens']:.0f} tokens, warm chunk cache"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
