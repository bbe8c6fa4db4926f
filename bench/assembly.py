"""What copying a batch's device hits into the requests' slots costs on the CPU.

    python bench/assembly.py [--out bench/results/assembly.json] [--rounds 15]

Assembly copies each chunk that the device tier holds from its chunk node's pool slots
into the request's own slots, keys re-rotated to the chunk's place. Two ways, timed side
by side in one run, rounds interleaved so that machine noise falls on both:

- ``per_hit``: one copy per chunk of all layers at once (``KVAccess.read``, a rotation
  of every layer's keys, ``write_rotated``), as assembly ran before ``copy_rotated``;
- ``batched``: ``KVAccess.copy_rotated`` over all the batch's hits, one layer at a time.

On a pool of the embedded model's KV shape (its ``config.json``), float32, one thread (as
assembly runs in the server), for the chunk counts and sizes of the workloads in
``bench/workloads.py``. Each round also checks that both leave the pool the same.
Reports the median milliseconds per batch and their ratio, with every round's figures.
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
from _server import ROOT, git_state  # noqa: E402

from sgl_pic.integration.kv_access import KVAccess  # noqa: E402
from sgl_pic.integration.model_rope import ModelRope  # noqa: E402
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


def hits(chunks: int, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(node slots, request slots, chunk start) of one batch: node slots in the upper half
    of the pool, request slots in the lower, both scattered as pages of a busy pool are."""
    g = torch.Generator().manual_seed(seed)
    half = POOL_SLOTS // 2
    src = torch.randperm(half, generator=g)[: chunks * tokens] + half
    dst = torch.randperm(half, generator=g)[: chunks * tokens]
    return [
        (src[i * tokens : (i + 1) * tokens], dst[i * tokens : (i + 1) * tokens], 40 + i * tokens)
        for i in range(chunks)
    ]


def per_hit(kv: KVAccess, batch: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    for src, dst, start in batch:
        kv.write_rotated(dst, kv.read(src), start)


def batched(kv: KVAccess, batch: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    kv.copy_rotated(
        torch.cat([s for s, _, _ in batch]),
        torch.cat([d for _, d, _ in batch]),
        torch.cat([torch.full((s.numel(),), start) for s, _, start in batch]),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "assembly.json"))
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

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
    for name, chunks, tokens in CASES:
        batch = hits(chunks, tokens, seed=chunks * 1000 + tokens)
        dst = torch.cat([d for _, d, _ in batch])
        times: dict[str, list[float]] = {"per_hit": [], "batched": []}
        for r in range(args.rounds + 1):
            written = {}
            for way, fn in (("per_hit", per_hit), ("batched", batched)):
                t0 = time.perf_counter()
                fn(kv, batch)
                dt = time.perf_counter() - t0
                written[way] = kv.read(dst)
                if r:  # round 0 warms up
                    times[way].append(dt * 1e3)
                    rows.append({"case": name, "round": r, "way": way, "ms": round(dt * 1e3, 3)})
            if not torch.equal(written["per_hit"], written["batched"]):
                print(f"{name}: the two ways wrote different KV", file=sys.stderr)
                return 1
        med = {w: statistics.median(t) for w, t in times.items()}
        paired = statistics.median(
            a / b for a, b in zip(times["per_hit"], times["batched"], strict=True)
        )
        summary[name] = {
            "tokens": chunks * tokens,
            "per_hit_ms": round(med["per_hit"], 2),
            "batched_ms": round(med["batched"], 2),
            "per_hit_over_batched_paired": round(paired, 2),
        }
        print(name, summary[name], flush=True)
    commit, dirty = git_state()
    report = {
        "git_commit": commit,
        "git_dirty": dirty,
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "model": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
        "rounds": args.rounds,
        "summary": summary,
        "rounds_ms": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
