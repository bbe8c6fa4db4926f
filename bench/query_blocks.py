"""How phase batches' queries are cut into SDPA blocks: fixed blocks of 128 queries (the
rule before ``attention.block_cuts``) against ``block_cuts``, on the query sets a live
server builds.

    python bench/query_blocks.py [--workload tools] [--requests 40]

1. Records: an sgl-pic server from this tree serves the first ``--requests`` requests of
   one ``bench/workloads.py`` stream (its flags and concurrency), and every query set its
   torch_native phase batches attend (``attention.query_blocks``: a request row's sorted
   query positions and its keys) is written to a file. The recording wraps that function
   in the server's processes through a ``sitecustomize`` module put on their PYTHONPATH
   by this script; the server itself is unchanged.
2. Times, in this process, each recorded set that is not a whole prompt (those are one
   causal block under either rule) with the embedded model's heads (float32, the server's
   CPU dtype): one layer's SDPA calls under each rule, the two timed back to back in
   alternating order, ``--rounds`` times, with the same K/V.

Reports, over all sets: the query-key pairs each rule attends against the pairs the
queries see (a query at position p sees p + 1 keys), the SDPA calls, and the seconds,
with the paired ratio. Results: ``bench/results/query_blocks.json`` (commit, dirty flag,
one record per set). Timings mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA, add_out_option, git_state, write_json  # noqa: E402
from _server import launch  # noqa: E402
from workload_streams import WORKLOADS, Streams, server_warmup  # noqa: E402
from workloads import (  # noqa: E402
    MAX_NEW_TOKENS,
    PASSAGE_TOKENS,
    SERVER_ARGS,
    config_flags,
    config_form,
    model_flags,
    run_stream,
    warm_up,
)

from sgl_pic.binding.attention import block_cuts  # noqa: E402

RECORD_VAR = "SGL_PIC_BENCH_QUERY_BLOCKS_OUT"
SITECUSTOMIZE = f'''
import json, os
_out = os.environ.get("{RECORD_VAR}")
if _out:
    from sgl_pic.binding import attention as _attention
    _query_blocks = _attention.query_blocks

    def _recording(q_index, num_keys):
        with open(_out, "a") as fh:
            fh.write(json.dumps({{"keys": int(num_keys), "q": q_index.tolist()}}) + "\\n")
        return _query_blocks(q_index, num_keys)

    _attention.query_blocks = _recording
'''
OLD_BLOCK = 128


def record(workload: str, requests: int, concurrency: int, out: Path) -> list[dict[str, Any]]:
    src = Streams(DEFAULT_DATA, PASSAGE_TOKENS, MAX_NEW_TOKENS)
    sessions = WORKLOADS[workload](src, requests, 1)
    with tempfile.TemporaryDirectory() as site:
        (Path(site) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {"PYTHONPATH": site, RECORD_VAR: str(out)}
        flags = config_flags(SERVER_ARGS + model_flags(workload), "sgl_pic")
        with launch(flags, env_extra=env) as client:
            warm_up(client, server_warmup(src, concurrency))
            out.unlink(missing_ok=True)  # the warm-up's plain forwards are not phase batches
            run_stream(client, sessions, config_form("sgl_pic"), concurrency, 10)
    sets = [json.loads(line) for line in out.read_text().splitlines()]
    if not sets:
        raise RuntimeError("the server recorded no query sets (is sgl-pic's path running?)")
    return sets


def fixed_cuts(n: int) -> list[tuple[int, int]]:
    return [(s, min(s + OLD_BLOCK, n)) for s in range(0, n, OLD_BLOCK)]


def attend(
    q: torch.Tensor,  # [1, heads, nq, head_dim]
    k: torch.Tensor,  # [1, kv_heads, num_keys, head_dim]
    v: torch.Tensor,  # [1, kv_heads, num_keys, head_dim]
    positions: torch.Tensor,  # [nq] sorted query positions
    cuts: list[tuple[int, int]],
) -> float:
    """Seconds of one layer's SDPA calls over ``cuts`` (masks built beforehand, as the
    server builds them once per forward)."""
    blocks = []
    for s, e in cuts:
        hi = int(positions[e - 1]) + 1
        blocks.append((s, e, hi, torch.arange(hi)[None, :] <= positions[s:e, None]))
    t0 = time.perf_counter()
    for s, e, hi, mask in blocks:
        scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, :hi], v[:, :, :hi], attn_mask=mask, enable_gqa=True
        )
    return time.perf_counter() - t0


def measure(sets: list[dict[str, Any]], rounds: int, heads: tuple[int, int, int]) -> list[dict]:
    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, rec in enumerate(sets):
        pos = torch.tensor(rec["q"], dtype=torch.int64)
        n, keys = pos.numel(), rec["keys"]
        if n == keys and bool((pos == torch.arange(n)).all()):
            continue  # a whole prompt: one causal block under either rule
        q = torch.randn(1, num_heads, n, head_dim, generator=gen)
        k = torch.randn(1, kv_heads, keys, head_dim, generator=gen)
        v = torch.randn(1, kv_heads, keys, head_dim, generator=gen)
        last = (pos + 1).tolist()
        rules = {"fixed_128": fixed_cuts(n), "block_cuts": block_cuts(last)}
        seconds: dict[str, list[float]] = {r: [] for r in rules}
        for r in range(rounds):
            order = list(rules) if (i + r) % 2 == 0 else list(reversed(rules))
            for name in order:
                seconds[name].append(attend(q, k, v, pos, rules[name]))
        rows.append(
            {
                "queries": n,
                "keys": keys,
                "seen_pairs": sum(last),
                **{
                    name: {
                        "calls": len(cuts),
                        "pairs": sum((e - s) * last[e - 1] for s, e in cuts),
                        "seconds": statistics.median(seconds[name]),
                    }
                    for name, cuts in rules.items()
                },
            }
        )
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    seen = sum(r["seen_pairs"] for r in rows)
    out: dict[str, Any] = {"query_sets": len(rows), "seen_pairs": seen}
    for name in ("fixed_128", "block_cuts"):
        out[name] = {
            "calls": sum(r[name]["calls"] for r in rows),
            "pairs_over_seen": sum(r[name]["pairs"] for r in rows) / max(seen, 1),
            "seconds": sum(r[name]["seconds"] for r in rows),
        }
    out["seconds_ratio"] = out["block_cuts"]["seconds"] / max(out["fixed_128"]["seconds"], 1e-12)
    out["paired_median_ratio"] = statistics.median(
        r["block_cuts"]["seconds"] / max(r["fixed_128"]["seconds"], 1e-12) for r in rows
    )
    return out


def model_heads() -> tuple[int, int, int]:
    from transformers import AutoConfig

    from sgl_pic.model.embedded import ensure_embedded_model

    cfg = AutoConfig.from_pretrained(str(ensure_embedded_model().path))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_attention_heads, cfg.num_key_value_heads, head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="tools", choices=sorted(WORKLOADS))
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads while timing")
    add_out_option(ap, "query_blocks.json")
    args = ap.parse_args()
    commit, dirty = git_state()
    with tempfile.TemporaryDirectory() as tmp:
        sets = record(args.workload, args.requests, args.concurrency, Path(tmp) / "sets.jsonl")
    torch.set_num_threads(args.threads)
    heads = model_heads()
    rows = measure(sets, args.rounds, heads)
    report = {
        "git_commit": commit,
        "git_dirty": dirty,
        "args": vars(args),
        "heads": dict(zip(("num_heads", "num_kv_heads", "head_dim"), heads, strict=True)),
        "summary": summary(rows),
        "records": rows,
    }
    print(json.dumps(report["summary"], indent=1))
    out = write_json(args.out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
