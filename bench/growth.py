"""How TTFT grows: full prefill and each policy, as the prompt grows and as the chunk count
grows, with warm chunks (device-tier hits).

    python bench/growth.py [--lengths 1024,2048,4096,7680] [--chunk-tokens 256]
                           [--counts 2,4,8,16,32] [--count-length 4096]

Sweep ``length``: prompts of L tokens in chunks of ``--chunk-tokens``. Sweep ``count``: a
prompt of ``--count-length`` tokens in n equal chunks. Chunk tokens are consecutive token
slices of MuSiQue passages laid end to end (timing does not depend on where a chunk's text
breaks), then a fresh question tail. Each point warms its chunks once (a chunked request
under full_recompute), then measures ``--reps`` rounds of: a plain request (full prefill)
and one request per policy, each with max_new_tokens=1 and a fresh header, so that SGLang's
prefix tree serves nothing and the chunks come from the device tier. TTFT is the client-side
latency; a point's figure is the median over the rounds.

The growth exponent is the least-squares slope of log TTFT over log length (or count).
The server gets ``--chunked-prefill-size`` above the longest prompt: longer prompts run
without reuse. Results: ``bench/results/growth.json`` and ``growth.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_data_option,
    add_out_option,
    add_server_args_option,
    embedded_tokenizer,
    git_state,
    write_json,  # noqa: E402
)
from _server import Client, delta, fresh_header, launch, metric  # noqa: E402

from sgl_pic.registry import POLICIES  # noqa: E402

TAIL = "Question: Which passage mentions a river?\nAnswer:"


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y over log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def measure(
    client: Client, tok: Any, stream: list[int], sizes: list[int], policies: list[str], reps: int
) -> dict[str, Any]:
    """One point: chunks of ``sizes`` tokens taken from ``stream`` in order."""
    ids: list[int] = []
    spans = []
    for n in sizes:
        spans.append([len(ids), len(ids) + n])
        ids += stream[len(ids) : len(ids) + n]
    ids += list(tok(TAIL, add_special_tokens=False)["input_ids"])

    def body(policy: str | None) -> dict[str, Any]:
        head = fresh_header(tok)
        out: dict[str, Any] = {
            "input_ids": head + ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        }
        if policy is not None:
            chunks = [[s + len(head), e + len(head)] for s, e in spans]
            out["pic"] = {"chunks": chunks, "config": {"policy": policy}}
        return out

    client.generate(body("full_recompute"))  # warm the chunk nodes
    ttft: dict[str, list[float]] = {"full_prefill": [], **{p: [] for p in policies}}
    device_ok = True
    for _ in range(reps):
        ttft["full_prefill"].append(client.generate(body(None))[0])
        for p in policies:
            before = client.metrics()
            ttft[p].append(client.generate(body(p))[0])
            d = delta(before, client.metrics())
            device_ok &= metric(d, "sgl_pic_tier_hits_total", tier="device") == len(sizes)
    return {
        "prompt_tokens": len(ids),
        "chunks": len(sizes),
        "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
        "ttft_all_s": ttft,
        "device_hits_ok": device_ok,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(ap)
    ap.add_argument("--lengths", default="1024,2048,4096,7680")  # SmolLM2: 8192 positions
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--counts", default="2,4,8,16,32")
    ap.add_argument("--count-length", type=int, default=4096)
    ap.add_argument("--policies", default="", help="comma list (default: every policy)")
    ap.add_argument("--reps", type=int, default=2)
    add_server_args_option(ap)
    ap.add_argument("--smoke", action="store_true")
    add_out_option(ap, "growth.json")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.counts, args.count_length, args.reps = "256,512", "2,4", 512, 1
        args.chunk_tokens = 128
    policies = args.policies.split(",") if args.policies else POLICIES.names()
    for p in policies:
        POLICIES.get(p)
    lengths = [int(x) for x in args.lengths.split(",")]
    counts = [int(x) for x in args.counts.split(",")]
    commit, dirty = git_state()

    from sgl_pic.prompts import load_rag_examples

    tok = embedded_tokenizer()
    longest = max(max(lengths), args.count_length)
    stream: list[int] = []
    for ex in load_rag_examples(args.data):
        for p in ex.passages:
            stream += list(tok(p + "\n\n", add_special_tokens=False)["input_ids"])
        if len(stream) > 4 * longest:
            break
    flags = [*shlex.split(args.server_args), "--chunked-prefill-size", str(longest + 256)]
    report: dict[str, Any] = {"git_commit": commit, "git_dirty": dirty, "args": vars(args)}
    with ExitStack() as stack:
        disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="sgl_pic_growth_"))
        client = stack.enter_context(launch([*flags, "--pic-disk-cache-dir", disk]))
        offset = 0  # each point takes fresh chunk text: no point hits another's chunks

        def point(sizes: list[int]) -> dict[str, Any]:
            nonlocal offset
            part = stream[offset % (len(stream) - longest) :]
            offset += sum(sizes) + 7
            r = measure(client, tok, part, sizes, policies, args.reps)
            print(json.dumps({k: r[k] for k in ("prompt_tokens", "chunks", "ttft_s")}), flush=True)
            return r

        by_length = [point([args.chunk_tokens] * (n // args.chunk_tokens)) for n in lengths]
        by_count = [point([args.count_length // n] * n) for n in counts]
    names = ["full_prefill", *policies]
    report["length"] = by_length
    report["count"] = by_count
    report["exponents"] = {
        "length": {
            k: slope([r["prompt_tokens"] for r in by_length], [r["ttft_s"][k] for r in by_length])
            for k in names
        },
        "count": {
            k: slope([r["chunks"] for r in by_count], [r["ttft_s"][k] for r in by_count])
            for k in names
        },
    }
    report["device_hits_ok"] = all(r["device_hits_ok"] for r in by_length + by_count)
    print(json.dumps(report["exponents"], indent=1))
    out = write_json(args.out, report)
    _plot(report, names, out.with_suffix(".png"))
    print(f"wrote {out}")


def _plot(report: dict[str, Any], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sweep, x in ((axes[0], "length", "prompt_tokens"), (axes[1], "count", "chunks")):
        rows = report[sweep]
        for k in names:
            e = report["exponents"][sweep][k]
            ax.plot(
                [r[x] for r in rows],
                [r["ttft_s"][k] for r in rows],
                "o-",
                label=f"{k} (slope {e:.2f})",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens" if sweep == "length" else "chunks (fixed length)")
        ax.set_ylabel("TTFT, s")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
