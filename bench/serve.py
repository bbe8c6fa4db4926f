"""TTFT through a running sgl_pic server: full prefill vs every policy, measured in one run.

    python -m sgl_pic.launch_server --port 30000 &
    python bench/serve.py --url http://127.0.0.1:30000 --examples 8

For each MuSiQue example (its first --passages passages; prompts must stay under SGLang's
--chunked-prefill-size, 4096 by default, or they run without reuse) the chunk store is
warmed once (a chunked request under full_recompute), then each measurement flushes
SGLang's prefix tree (/flush_cache, which leaves the chunk store warm) and sends one request
with max_new_tokens=1: a plain request for full prefill, a chunked one with the policy
override for each policy. TTFT is the client-side latency of that request. Ratios are
full-prefill TTFT over policy TTFT from the same run. Results go to bench/results/serve.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import requests

POLICIES = ("full_recompute", "full_reuse", "epic", "daric", "cachetune")
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"


def _post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json=body, timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def _flush(url: str) -> None:
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sgl_pic") and "_bucket" not in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--examples", type=int, default=8)
    # MuSiQue passages are ~600 tokens with this tokenizer: 10 passages cut to 280 tokens
    # make a ~3k-token prompt (SGLang's --chunked-prefill-size is 4096 by default).
    ap.add_argument("--passages", type=int, default=10, help="passages (chunks) per prompt")
    ap.add_argument("--passage-tokens", type=int, default=280, help="truncate passages (0: no)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from sgl_pic.model.embedded import ensure_embedded_model
    from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_model().path))
    examples = [ex for ex in load_rag_examples(args.data) if len(ex.passages) >= args.passages][
        : args.examples
    ]
    if not examples:
        raise SystemExit(f"no example has {args.passages} passages")
    sampling = {"temperature": 0, "max_new_tokens": 1}
    ttft: dict[str, list[float]] = {"full_prefill": [], **{p: [] for p in POLICIES}}
    per_policy: dict[str, dict[str, float]] = {}
    lengths = []
    for ex in examples:
        passages = [truncate_tokens(tok, p, args.passage_tokens) for p in ex.passages]
        prompt = build_prompt(tok, passages[: args.passages], ex.question)
        ids = prompt.token_ids.tolist()
        spans = [[s.start, s.end] for s in prompt.layout.chunks]
        lengths.append(len(ids))
        chunked = {"input_ids": ids, "sampling_params": sampling}
        _flush(args.url)
        _post(
            args.url, {**chunked, "pic": {"chunks": spans, "config": {"policy": "full_recompute"}}}
        )
        _flush(args.url)
        ttft["full_prefill"].append(_post(args.url, chunked)[0])
        for policy in POLICIES:
            _flush(args.url)
            before = _metrics(args.url)
            body = {**chunked, "pic": {"chunks": spans, "config": {"policy": policy}}}
            ttft[policy].append(_post(args.url, body)[0])
            after = _metrics(args.url)
            acc = per_policy.setdefault(policy, {})
            for k in after:
                acc[k] = acc.get(k, 0.0) + after[k] - before.get(k, 0.0)

    base = statistics.mean(ttft["full_prefill"])
    report: dict[str, Any] = {
        "examples": len(examples),
        "passages": args.passages,
        "passage_tokens": args.passage_tokens,
        "mean_prompt_tokens": statistics.mean(lengths),
        "ttft_mean_s": {k: statistics.mean(v) for k, v in ttft.items()},
        "speedup_vs_full_prefill": {p: base / statistics.mean(ttft[p]) for p in POLICIES},
        "hit_rate": {},
        "recomputed_fraction": {},
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    _plot(report, Path(args.out).with_suffix(".png"))


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["full_prefill", *POLICIES]
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
