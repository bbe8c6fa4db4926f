"""What one decoder layer's weights cost per token as the forward's token count grows.

    python bench/layer_batch.py [--out bench/results/layer_batch.json]

The chunk path runs a batch as up to three forwards (phase 1, the query probe, phase 2),
each over fewer tokens than SGLang's one forward of the whole batch. On a CPU the dense
layers cost more per token in a small forward (the weights are read once per forward
whatever the token count). This times the embedded model's own dense layers (its
``config.json``: QKV and output projections, gated MLP) at 8 to 2048 tokens, in its
serving dtype (float32) and in bfloat16, interleaving the sizes over rounds so that
machine noise spreads over all of them, and reports the median microseconds per token
and the ratio to the 1024-token figure. Attention is left out: its cost depends on the
context, not on the weights.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_out_option, git_state, write_json  # noqa: E402

if TYPE_CHECKING:
    import torch
# torch is imported where it is used, after the arguments are parsed: --help answers at once.

SIZES = (8, 32, 64, 128, 256, 512, 1024, 2048)


def dense_layer(
    hidden: int, inter: int, q_dim: int, kv_dim: int, dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The dense part of one Llama decoder layer, random weights of the model's shapes."""
    import torch
    from torch.nn.functional import linear, silu

    g = torch.Generator().manual_seed(0)
    w_qkv = torch.randn(q_dim + 2 * kv_dim, hidden, generator=g).to(dtype)
    w_o = torch.randn(hidden, q_dim, generator=g).to(dtype)
    w_gate_up = torch.randn(2 * inter, hidden, generator=g).to(dtype)
    w_down = torch.randn(hidden, inter, generator=g).to(dtype)

    def run(x: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        qkv = linear(x, w_qkv)
        h = x + linear(qkv[:, :q_dim], w_o)
        gate_up = linear(h, w_gate_up)
        return h + linear(silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(ap, "layer_batch.json")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    from sgl_pic.model.embedded import ensure_embedded_model

    cfg = json.loads((ensure_embedded_model().path / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    q_dim, kv_dim = hidden, cfg["num_key_value_heads"] * head_dim
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer = dense_layer(hidden, inter, q_dim, kv_dim, dtype)
        xs = {n: torch.randn(n, hidden).to(dtype) for n in SIZES}
        per_token: dict[int, list[float]] = {n: [] for n in SIZES}
        for n in SIZES:
            layer(xs[n])  # warm-up
        for _ in range(args.rounds):
            for n in SIZES:
                reps = max(3, 2048 // n)
                t0 = time.perf_counter()
                for _ in range(reps):
                    layer(xs[n])
                per_token[n].append((time.perf_counter() - t0) / reps / n * 1e6)
        med = {n: statistics.median(v) for n, v in per_token.items()}
        results[str(dtype).removeprefix("torch.")] = {
            "us_per_token": {str(n): round(med[n], 2) for n in SIZES},
            "ratio_to_1024": {str(n): round(med[n] / med[1024], 2) for n in SIZES},
        }
    commit, dirty = git_state()
    report = {
        "git_commit": commit,
        "git_dirty": dirty,
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "model": {"hidden": hidden, "intermediate": inter, "q_dim": q_dim, "kv_dim": kv_dim},
        "rounds": args.rounds,
        "results": results,
    }
    for name, r in results.items():
        print(name, "us/token:", r["us_per_token"], "ratio to 1024:", r["ratio_to_1024"])
    write_json(args.out, report, indent=2, newline=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
