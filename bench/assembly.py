"""What copying a batch's device hits into the requests' slots costs on the CPU.

    python bench/assembly.py [--out bench/results/assembly.json] [--rounds 15]

Assembly copies each chunk that the device tier holds from its chunk node's pool slots
into the request's own slots, keys re-rotated to the chunk's place
(``KVAccess.copy_rotated``, all the batch's hits in one call, one layer at a time). Two
ways, timed side by side in one run, rounds interleaved so that machine noise falls on
both:

- ``gathered``: every row gathered (``index_select``), keys rotated, rows scattered
  (``index_copy_``), as ``copy_rotated`` ran up to 985911b;
- ``slices``: runs of rows over consecutive slots on both sides copied slice to slice,
  keys rotated straight into their new rows (``slice_runs``; the rest gathered).

Two layouts of the slots: ``runs``, each chunk's node slots one range at a random place
and a request's slots one range (what the server holds: an instrumented run of tools
requests found nearly all the rows assembly copied in such runs), and ``scattered``,
every slot drawn at random (a pool fragmented page by page; no runs, so both ways
gather). On a pool of the embedded
model's KV shape (its ``config.json``), float32, one thread (as assembly runs in the
server), for the chunk counts and sizes of the workloads in ``bench/workloads.py``. Each
round also checks that both leave the pool the same, bit for bit. Reports the median
milliseconds per batch and their ratio (paired per round), with every round's figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_out_option, git_state, write_json  # noqa: E402

from sgl_pic.engine.kv_access import KVAccess  # noqa: E402
from sgl_pic.engine.rotation import ModelRope  # noqa: E402
from sgl_pic.rope import default_inv_freq  # noqa: E402

POOL_SLOTS = 40_000
# (name, chunks per batch, tokens per chunk): one tools or fewshot request (8 tools or
# demonstrations of ~100 tokens), one RAG request (6 passages of 120), a single chunk.
CASES = (("8x100", 8, 100), ("6x120", 6, 120), ("1x100", 1, 100), ("16x100", 16, 100))


class Pool:
    """Per-layer K and V buffers # [slots, kv_heads, head_dim] (SGLang's pool interface)."""

    def __init__(self, layers: int, heads: int, head_dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        shape = (POOL_SLOTS, heads, head_dim)
        self.k = [torch.randn(shape, generator=g) for _ in range(layers)]
        self.v = [torch.randn(shape, generator=g) for _ in range(layers)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def hits(
    chunks: int, tokens: int, seed: int, layout: str
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(node slots, request slots, chunk start) of one batch: node slots in the upper half
    of the pool, request slots in the lower (``layout``: see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    half = POOL_SLOTS // 2
    n = chunks * tokens
    if layout == "scattered":
        src = torch.randperm(half, generator=g)[:n] + half
        dst = torch.randperm(half, generator=g)[:n]
    else:
        places = torch.randperm(half // tokens, generator=g)[:chunks] * tokens + half
        src = torch.cat([torch.arange(p, p + tokens) for p in places.tolist()])
        first = int(torch.randint(0, half - n, (1,), generator=g))
        dst = torch.arange(first, first + n)
    return [
        (src[i * tokens : (i + 1) * tokens], dst[i * tokens : (i + 1) * tokens], 40 + i * tokens)
        for i in range(chunks)
    ]


def copy(kv: KVAccess, batch: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    kv.copy_rotated(
        torch.cat([s for s, _, _ in batch]),
        torch.cat([d for _, d, _ in batch]),
        torch.cat([torch.full((s.numel(),), start) for s, _, start in batch]),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(ap, "assembly.json")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    commit, dirty = git_state()  # the tree whose code runs, whatever HEAD is at the end

    from sgl_pic.model.embedded import ensure_embedded_model

    cfg = json.loads((ensure_embedded_model().path / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq = default_inv_freq(head_dim, float(cfg.get("rope_theta", 10000.0)))
    torch.set_num_threads(1)
    pool = Pool(layers, kv_heads, head_dim)
    kv = KVAccess(pool, layers, ModelRope.plain(inv_freq))
    rows = []
    summary = {}
    ways = {"gathered": 1 << 30, "slices": kv.slice_rows}
    for layout in ("runs", "scattered"):
        for name, chunks, tokens in CASES:
            batch = hits(chunks, tokens, seed=chunks * 1000 + tokens, layout=layout)
            dst = torch.cat([d for _, d, _ in batch])
            times: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(args.rounds + 1):
                written = {}
                order = list(ways) if r % 2 else list(reversed(ways))
                for way in order:
                    kv.slice_rows = ways[way]
                    t0 = time.perf_counter()
                    copy(kv, batch)
                    dt = time.perf_counter() - t0
                    written[way] = kv.read(dst)
                    if r:  # round 0 warms up
                        times[way].append(dt * 1e3)
                        rows.append(
                            {"layout": layout, "case": name, "round": r, "way": way}
                            | {"ms": round(dt * 1e3, 3)}
                        )
                if not torch.equal(written["gathered"], written["slices"]):
                    print(f"{layout} {name}: the two ways wrote different KV", file=sys.stderr)
                    return 1
            med = {w: statistics.median(t) for w, t in times.items()}
            paired = statistics.median(
                a / b for a, b in zip(times["gathered"], times["slices"], strict=True)
            )
            key = f"{layout}/{name}"
            summary[key] = {
                "tokens": chunks * tokens,
                "gathered_ms": round(med["gathered"], 2),
                "slices_ms": round(med["slices"], 2),
                "gathered_over_slices_paired": round(paired, 2),
            }
            print(key, summary[key], flush=True)
    report = {
        "git_commit": commit,
        "git_dirty": dirty,
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "model": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
        "rounds": args.rounds,
        "summary": summary,
        "rounds_ms": rows,
    }
    write_json(args.out, report, indent=2, newline=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
