"""How TTFT grows: full prefill and each policy, as the prompt grows and as the chunk count
grows, with warm chunks (device-tier hits).

    python bench/growth.py [--lengths 1024,2048,4096,7680] [--chunk-tokens 256]
                           [--counts 2,4,8,16,32] [--count-length 4096]
                           [--pieces unsplit,default,1024]

Sweep ``length``: prompts of L tokens in chunks of ``--chunk-tokens``. Sweep ``count``: a
prompt of ``--count-length`` tokens in n equal chunks. Chunk tokens are consecutive token
slices of MuSiQue passages laid end to end (timing does not depend on where a chunk's text
breaks), then a fresh question tail. Each point warms its chunks once (a chunked request
under full_recompute), then measures ``--reps`` rounds of: a plain request (full prefill)
and one request per policy, each with max_new_tokens=1 and a fresh header, so that SGLang's
prefix tree serves nothing and the chunks come from the device tier. The measured
requests take the chunks in another order than the warming one (rotated by one chunk):
position-independent reuse, not a prefix. TTFT is the client-side latency; a point's figure
is the median over the rounds, and its speedup the median of the rounds' paired ratios
(plain TTFT / policy TTFT in the same round).

``--pieces`` runs the sweeps once per prefill piece size, each on a fresh server:
``unsplit`` (``--chunked-prefill-size`` above the longest prompt: every prompt one piece),
``default`` (the server's own size: longer prompts are split into pieces, each request
planned once at its first piece) or a number of tokens (1024 shows what GPU-sized contexts
see, split into many pieces). The report gives each size's speedups and their ratio to the
unsplit server's at each length.

The growth exponent is the least-squares slope of log TTFT over log length (or count).
Results: ``bench/results/growth.json`` and ``growth.png``.
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
    # Measured in another order: the first chunk moved to the end.
    order = list(range(1, len(sizes))) + [0]
    reordered: list[int] = []
    new_spans = []
    for i in order:
        a, b = spans[i]
        new_spans.append([len(reordered), len(reordered) + b - a])
        reordered += ids[a:b]
    reordered += ids[spans[-1][1] :]
    ids, spans = reordered, new_spans
    ttft: dict[str, list[float]] = {"full_prefill": [], **{p: [] for p in policies}}
    device_ok = True
    pieces = {p: 0.0 for p in policies}
    fallbacks = 0.0
    for _ in range(reps):
        ttft["full_prefill"].append(client.generate(body(None))[0])
        for p in policies:
            before = client.metrics()
            ttft[p].append(client.generate(body(p))[0])
            d = delta(before, client.metrics())
            device_ok &= metric(d, "sgl_pic_tier_hits_total", tier="device") == len(sizes)
            pieces[p] = max(pieces[p], metric(d, "sgl_pic_prefill_pieces_total"))
            fallbacks += metric(d, "sgl_pic_fallbacks_total")
    plain = ttft["full_prefill"]
    return {
        "prompt_tokens": len(ids),
        "chunks": len(sizes),
        "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
        "ttft_all_s": ttft,
        "speedup": {
            p: statistics.median(a / b for a, b in zip(plain, ttft[p], strict=True))
            for p in policies
        },
        "prefill_pieces": pieces,
        "fallbacks": fallbacks,
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
    ap.add_argument(
        "--pieces",
        default="unsplit,default,1024",
        help="prefill piece sizes, one server each: unsplit, default, or tokens",
    )
    add_server_args_option(ap)
    ap.add_argument("--smoke", action="store_true")
    add_out_option(ap, "growth.json")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.counts, args.count_length, args.reps = "256,512", "2,4", 512, 1
        args.chunk_tokens, args.pieces = 128, "unsplit,128"
    policies = args.policies.split(",") if args.policies else POLICIES.names()
    for p in policies:
        POLICIES.get(p)
    lengths = [int(x) for x in args.lengths.split(",")]
    counts = [int(x) for x in args.counts.split(",") if x]
    commit, dirty = git_state()

    from sgl_pic.prompts import load_rag_examples

    tok = embedded_tokenizer()
    longest = max(max(lengths), args.count_length if counts else 0)
    stream: list[int] = []
    for ex in load_rag_examples(args.data):
        for p in ex.passages:
            stream += list(tok(p + "\n\n", add_special_tokens=False)["input_ids"])
        if len(stream) > 4 * longest:
            break
    report: dict[str, Any] = {"git_commit": commit, "git_dirty": dirty, "args": vars(args)}
    servers: dict[str, Any] = {}
    for size in args.pieces.split(","):
        flags = shlex.split(args.server_args)
        if size == "unsplit":
            flags += ["--chunked-prefill-size", str(longest + 256)]
        elif size != "default":
            flags += ["--chunked-prefill-size", str(int(size))]
        print(f"server: pieces {size}", flush=True)
        servers[size] = sweep(flags, stream, tok, lengths, counts, policies, args)
    report["servers"] = servers
    if "unsplit" in servers:
        # Each size's speedup at each length, as a fraction of the unsplit server's.
        base = servers["unsplit"]["length"]
        report["speedup_vs_unsplit"] = {
            size: [
                {
                    "prompt_tokens": r["prompt_tokens"],
                    **{p: r["speedup"][p] / b["speedup"][p] for p in policies},
                }
                for r, b in zip(run["length"], base, strict=True)
            ]
            for size, run in servers.items()
        }
        print(json.dumps(report["speedup_vs_unsplit"], indent=1))
    out = write_json(args.out, report)
    _plot(servers, ["full_prefill", *policies], out.with_suffix(".png"))
    print(f"wrote {out}")


def sweep(
    flags: list[str],
    stream: list[int],
    tok: Any,
    lengths: list[int],
    counts: list[int],
    policies: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Both sweeps on one fresh server started with ``flags``."""
    longest = max(max(lengths), args.count_length if counts else 0)
    with ExitStack() as stack:
        disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="sgl_pic_growth_"))
        client = stack.enter_context(launch([*flags, "--pic-disk-cache-dir", disk]))
        offset = 0  # each point takes fresh chunk text: no point hits another's chunks

        def point(sizes: list[int]) -> dict[str, Any]:
            nonlocal offset
            part = stream[offset % (len(stream) - longest) :]
            offset += sum(sizes) + 7
            r = measure(client, tok, part, sizes, policies, args.reps)
            keys = ("prompt_tokens", "chunks", "ttft_s", "speedup", "prefill_pieces")
            print(json.dumps({k: r[k] for k in keys}), flush=True)
            return r

        by_length = [point([args.chunk_tokens] * (n // args.chunk_tokens)) for n in lengths]
        by_count = [point([args.count_length // n] * n) for n in counts]
    names = ["full_prefill", *policies]
    run: dict[str, Any] = {"flags": flags, "length": by_length, "count": by_count}
    sweeps = (("length", by_length, "prompt_tokens"), ("count", by_count, "chunks"))
    run["exponents"] = {
        sweep: {
            k: slope([r[x] for r in rows], [r["ttft_s"][k] for r in rows])
            if len(rows) > 1
            else None
            for k in names
        }
        for sweep, rows, x in sweeps
    }
    run["device_hits_ok"] = all(r["device_hits_ok"] for r in by_length + by_count)
    run["fallbacks"] = sum(r["fallbacks"] for r in by_length + by_count)
    print(json.dumps(run["exponents"], indent=1))
    return run


def _plot(servers: dict[str, Any], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(servers), 2, figsize=(10, 4 * len(servers)), squeeze=False)
    for row, (size, run) in zip(axes, servers.items(), strict=True):
        for ax, sweep, x in ((row[0], "length", "prompt_tokens"), (row[1], "count", "chunks")):
            rows = run[sweep]
            if not rows:
                ax.set_visible(False)
                continue
            for k in names:
                e = run["exponents"][sweep][k]
                slope_text = "" if e is None else f" (slope {e:.2f})"
                ax.plot(
                    [r[x] for r in rows], [r["ttft_s"][k] for r in rows], "o-", label=k + slope_text
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens" if sweep == "length" else "chunks (fixed length)")
            ax.set_ylabel(f"TTFT, s (pieces: {size})")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
