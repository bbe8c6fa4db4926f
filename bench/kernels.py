"""Benchmark of the KV ops: correctness against the reference, then bandwidth.

    python bench/kernels.py [--out-dir bench/results] [--max-tokens N] [--max-gb G]

First every op runs on fresh random inputs through the public API and the torch
reference, and must agree (copies bit for bit, RoPE within float32 rounding); a
mismatch exits 1. Then each op is timed against a plain contiguous copy of the same
bytes (``dst.copy_(src)``) measured in the same run, for 1k to 1M tokens and two KV
shapes, with CUDA events. Bandwidth counts bytes read plus bytes written of KV rows
(indices are not counted). Writes ``<out-dir>/kernels_<device>.json`` and prints a table
of ratios. On a machine without CUDA it times the torch reference on the CPU at small
sizes, labelled as such, so that the script itself is exercised.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import sgl_pic.ops as ops  # noqa: E402
from sgl_pic.ops import reference  # noqa: E402
from sgl_pic.rope import default_inv_freq  # noqa: E402


class Shape(NamedTuple):
    name: str
    layers: int
    heads: int
    head_dim: int


SHAPES = (Shape("smollm2_30x3x64", 30, 3, 64), Shape("large_30x8x128", 30, 8, 128))
GPU_TOKENS = (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000)
CPU_TOKENS = (1_000,)
REUSED = 0.85  # share of a chunk's tokens gathered; the rest is recomputed and scattered
DTYPE = torch.bfloat16
PINNED_MAX_BYTES = 1 << 30  # pinned host sources beyond this take seconds to allocate


class Timing(NamedTuple):
    seconds: float  # median of the timed runs
    runs: int


def timer(device: torch.device) -> Callable[[Callable[[], Any]], Timing]:
    def run(fn: Callable[[], Any]) -> Timing:
        fn()  # warm-up: library load, allocator, caches
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            once = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            once = time.perf_counter() - t0
        runs = max(3, min(50, int(0.2 / max(once, 1e-6))))
        samples = []
        for _ in range(runs):
            if device.type == "cuda":
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        samples.sort()
        return Timing(samples[len(samples) // 2], runs)

    return run


def rand(gen: torch.Generator, *shape: int, device: torch.device, dtype=DTYPE) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def check_correctness(device: torch.device, gen: torch.Generator) -> list[dict[str, Any]]:
    """Public op vs reference on fresh random inputs, every dtype and layout."""
    rows: list[dict[str, Any]] = []
    # Small on the CPU, where the reference is both sides and only the script is exercised.
    num_layers, tokens, slots = (4, 3000, 4000) if device.type == "cuda" else (2, 300, 400)
    reused = tokens * 5 // 6

    def ids(n: int, bound: int) -> torch.Tensor:
        return torch.randperm(bound, generator=gen, device=device)[:n]

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for heads, head_dim in ((3, 64), (8, 128)):
            src = rand(gen, num_layers, tokens, heads, head_dim, device=device, dtype=dtype)
            pool = rand(gen, num_layers, slots, heads, head_dim, device=device, dtype=dtype)
            tok, slot = ids(reused, tokens), ids(reused, slots)
            scatter_slots = ids(tokens, slots)
            # Each case: (public op, reference, args with None where the pool goes).
            cases: dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple]] = {
                "gather_kv": (ops.gather_kv, reference.gather_kv, (src, tok, None, slot)),
                "scatter_kv": (ops.scatter_kv, reference.scatter_kv, (src, None, scatter_slots)),
            }
            inv_freq = default_inv_freq(head_dim, 10000.0, device=device)
            pos = torch.randint(0, 1 << 20, (reused,), generator=gen, device=device)
            old = torch.randint(0, 1 << 20, (reused,), generator=gen, device=device)
            for layout in ("neox", "interleaved"):
                cases[f"apply_rope_kv/{layout}"] = (
                    ops.apply_rope_kv,
                    reference.apply_rope_kv,
                    (None, pos, inv_freq, layout, 1.0, slot),
                )
                cases[f"rerotate_kv/{layout}"] = (
                    ops.rerotate_kv,
                    reference.rerotate_kv,
                    (None, old, pos, inv_freq, layout, slot),
                )
            for name, (op, ref, args) in cases.items():
                got, want = list(pool.clone().unbind(0)), pool.clone()
                where = args.index(None)  # the pool argument
                backend = op(*args[:where], got, *args[where + 1 :]).backend
                ref(*args[:where], want, *args[where + 1 :])
                diff = (torch.stack(got).float() - want.float()).abs().max().item()
                exact = name.startswith(("gather", "scatter"))
                tol = 0.0 if exact else (1e-5 if dtype == torch.float32 else 2**-6)
                rows.append(
                    {
                        "op": name,
                        "dtype": str(dtype).removeprefix("torch."),
                        "row": [heads, head_dim],
                        "backend": backend,
                        "max_abs_diff": diff,
                        "ok": diff <= tol,
                    }
                )
    return rows


def bench_shape(
    shape: Shape, n: int, device: torch.device, gen: torch.Generator, run: Callable, ref_too: bool
) -> list[dict[str, Any]]:
    layers, heads, head_dim = shape.layers, shape.heads, shape.head_dim
    row_bytes = heads * head_dim * torch.finfo(DTYPE).bits // 8
    n_gather = int(n * REUSED)
    n_scatter = n - n_gather
    src = rand(gen, layers, n, heads, head_dim, device=device)
    pool = list(rand(gen, layers, n, heads, head_dim, device=device).unbind(0))  # SGLang pool
    tokens = torch.randperm(n, generator=gen, device=device)[:n_gather].sort().values
    slots = torch.randperm(n, generator=gen, device=device)
    fresh = rand(gen, layers, n_scatter, heads, head_dim, device=device)
    positions = torch.randint(0, 1 << 20, (n_gather,), generator=gen, device=device)
    old = torch.randint(0, 1 << 20, (n_gather,), generator=gen, device=device)
    inv_freq = default_inv_freq(head_dim, 10000.0, device=device)
    g_slots, s_slots = slots[:n_gather], slots[n_gather:]

    all_bytes = 2 * n_gather * row_bytes * layers  # read + write of the rows touched
    cases: dict[str, tuple[int, Callable[[Any], Callable[[], Any]]]] = {
        "gather_kv": (all_bytes, lambda m: lambda: m.gather_kv(src, tokens, pool, g_slots)),
        "gather_kv_layer": (
            all_bytes // layers,
            lambda m: lambda: m.gather_kv_layer(src[0], tokens, pool[0], g_slots),
        ),
        "scatter_kv": (
            2 * n_scatter * row_bytes * layers,
            lambda m: lambda: m.scatter_kv(fresh, pool, s_slots),
        ),
        "apply_rope_kv": (
            all_bytes,
            lambda m: lambda: m.apply_rope_kv(pool, positions, inv_freq, slot_ids=g_slots),
        ),
        "rerotate_kv": (
            all_bytes,
            lambda m: lambda: m.rerotate_kv(pool, old, positions, inv_freq, slot_ids=g_slots),
        ),
    }
    if device.type == "cuda" and n * row_bytes * layers <= PINNED_MAX_BYTES:
        host = src.cpu().pin_memory()
        cases["gather_kv/pinned_host"] = (
            all_bytes,
            lambda m: lambda: m.gather_kv(host, tokens, pool, g_slots),
        )

    results = []
    baselines: dict[int, Timing] = {}
    for name, (nbytes, make) in cases.items():
        if nbytes not in baselines:
            half = nbytes // 2
            a = torch.empty(half, dtype=torch.uint8, device=device).random_(generator=gen)
            b = torch.empty_like(a)
            baselines[nbytes] = run(lambda a=a, b=b: b.copy_(a))
            del a, b
        backend = make(ops)().backend
        t = run(make(ops))
        base = baselines[nbytes]
        entry = {
            "op": name,
            "shape": shape.name,
            "tokens": n,
            "rows_touched": n_scatter if name == "scatter_kv" else n_gather,
            "bytes": nbytes,
            "backend": backend,
            "seconds": t.seconds,
            "gbps": nbytes / t.seconds / 1e9,
            "copy_gbps": nbytes / base.seconds / 1e9,
            "ratio_to_copy": base.seconds / t.seconds,
            "runs": t.runs,
        }
        if ref_too and backend != "reference":
            r = run(make(reference))
            entry["reference_gbps"] = nbytes / r.seconds / 1e9
            entry["speedup_vs_reference"] = r.seconds / t.seconds
        results.append(entry)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-gb", type=float, default=40.0, help="cap on src + pool bytes")
    parser.add_argument("--no-reference", action="store_true", help="skip reference timings")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tokens, label = GPU_TOKENS, "CUDA kernels (reference timed alongside)"
    else:
        name = "cpu"
        tokens, label = CPU_TOKENS, "CPU REFERENCE TIMINGS ONLY (torch; no CUDA on this machine)"
    if args.max_tokens is not None:
        tokens = tuple(t for t in tokens if t <= args.max_tokens)
    if device.type == "cuda":
        ops.prepare_cuda(device)  # built and launch-tested here, as the server does at start-up
    print(f"device: {name} | {label} | cuda: {ops.cuda_status()}")

    correctness = check_correctness(device, gen)
    bad = [c for c in correctness if not c["ok"]]
    print(f"correctness: {len(correctness) - len(bad)}/{len(correctness)} cases agree")
    for c in bad:
        print(f"  MISMATCH {c}")

    results: list[dict[str, Any]] = []
    for shape in SHAPES:
        per_token = 2 * shape.layers * shape.heads * shape.head_dim * torch.finfo(DTYPE).bits // 8
        for n in tokens:
            if n * per_token > args.max_gb * 1e9:
                print(f"skip {shape.name} at {n} tokens: {n * per_token / 1e9:.0f} GB > --max-gb")
                continue
            results.extend(bench_shape(shape, n, device, gen, timer(device), not args.no_reference))
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print(f"\n{label}; bf16; GB/s = (bytes read + written) / median time")
    header = f"{'op':<24}{'shape':<18}{'tokens':>9}{'GB/s':>10}{'copy GB/s':>11}{'ratio':>8}"
    print(header + f"{'vs ref':>9}")
    for r in results:
        speedup = f"{r['speedup_vs_reference']:>8.1f}x" if "speedup_vs_reference" in r else ""
        print(
            f"{r['op']:<24}{r['shape']:<18}{r['tokens']:>9}{r['gbps']:>10.1f}"
            f"{r['copy_gbps']:>11.1f}{r['ratio_to_copy']:>8.2f}{speedup}"
        )

    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"kernels_{slug}.json"
    report = {
        "device": name,
        "label": label,
        "dtype": str(DTYPE).removeprefix("torch."),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_status": ops.cuda_status()._asdict() | {"library": str(ops.cuda_status().library)},
        "reused_fraction": REUSED,
        "correctness": correctness,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
