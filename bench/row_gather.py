"""Gathering a request row's K/V from the pool, as the phase path's torch_native attention
and the query probe do once per layer: ``buffer.index_select(0, slots)`` against
``buffer[slots]`` (advanced indexing), side by side.

Each of ``--layers`` layers has its own K and V buffer of ``--pool`` slots (SmolLM2's
[3, 64] float32 rows), so that a forward's gathers read memory that is not in cache, as
in the server; the row's slots are a random draw from the pool (a pool after some churn).
Per round and row length, both ways gather every layer's K and V, in alternating order;
the ratio is paired per round. Results: ``bench/results/row_gather.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_out_option, git_state, write_json  # noqa: E402

if TYPE_CHECKING:
    import torch
# torch is imported where it is used, after the arguments are parsed: --help answers at once.

KV_HEADS, HEAD_DIM = 3, 64


def gather_ms(
    buffers: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [pool, heads, dim] K, V
    slots: torch.Tensor,  # [n] int64
    way: str,
) -> float:
    t0 = time.perf_counter()
    for kb, vb in buffers:
        if way == "index_select":
            kb.index_select(0, slots)
            vb.index_select(0, slots)
        else:
            kb[slots]
            vb[slots]
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--pool", type=int, default=20000)
    ap.add_argument("--rows", default="300,1000,1500")
    ap.add_argument("--rounds", type=int, default=9)
    add_out_option(ap, "row_gather.json")
    args = ap.parse_args()
    import torch

    commit, dirty = git_state()
    g = torch.Generator().manual_seed(0)
    buffers = [
        (
            torch.randn(args.pool, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(args.pool, KV_HEADS, HEAD_DIM, generator=g),
        )
        for _ in range(args.layers)
    ]
    ways = ("index_select", "indexing")
    rounds = []
    for r in range(args.rounds):
        for n in (int(x) for x in args.rows.split(",")):
            slots = torch.randperm(args.pool, generator=g)[:n]
            order = ways if r % 2 == 0 else ways[::-1]
            ms = {way: gather_ms(buffers, slots, way) for way in order}
            rounds.append({"round": r, "row_tokens": n, **ms})
    summary = {}
    for n in sorted({x["row_tokens"] for x in rounds}):
        rs = [x for x in rounds if x["row_tokens"] == n]
        summary[str(n)] = {
            "index_select_ms": statistics.median(x["index_select"] for x in rs),
            "indexing_ms": statistics.median(x["indexing"] for x in rs),
            "indexing_over_index_select_paired": statistics.median(
                x["indexing"] / x["index_select"] for x in rs
            ),
        }
        print(n, json.dumps({k: round(v, 3) for k, v in summary[str(n)].items()}), flush=True)
    report = {
        "git_commit": commit,
        "git_dirty": dirty,
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "summary": summary,
        "rounds": rounds,
    }
    out = write_json(args.out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
