"""The serving path's torch-side ops on CUDA, each checked against the CPU reference.

    python bench/gpu_serving_ops.py [--cpu-dry-run] [--out-dir DIR]

Plain Python (no pytest, no SGLang): a toy pool exposing SGLang's ``get_key_buffer`` /
``get_value_buffer`` stands in for the server's KV pool. Checks:

    pool_ops      read / write of every layer at scattered slots, and key rotation by a
                  per-slot position delta (``sgl_pic.ops`` pool functions), CUDA vs CPU;
    layer_feed    sparse loading of lower-tier chunks from pinned host memory by the
                  server's ``LayerFeed``: copies on a side stream, one CUDA event per
                  layer, the forward stream waiting on them (not the host), CUDA vs CPU;
    kv_access     the server's ``KVAccess`` writes and rotations on a CUDA pool vs CPU.

Prints one line per check and a JSON summary, also written to ``$OUT`` (or --out-dir) as
gpu_serving_ops.json. Exit 0 when every check passed, 1 otherwise, 3 when there is no
CUDA device (unless --cpu-dry-run, which runs the same checks with the CPU standing in
for the GPU, to prove the script and its imports work).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import sgl_pic.ops as ops  # noqa: E402
from sgl_pic.rope import default_inv_freq, rotate_layers  # noqa: E402

LAYERS, SLOTS, HEADS, DIM = 6, 512, 4, 64
THETA = 10000.0


class ToyPool:
    """Per-layer K and V buffers # [SLOTS, HEADS, DIM], separate tensors as in SGLang."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, device: str) -> None:
        self.k = [t.to(device).clone() for t in k.unbind(0)]
        self.v = [t.to(device).clone() for t in v.unbind(0)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """# [LAYERS, SLOTS, HEADS, DIM] CPU copies of K and V (syncs)."""
        return torch.stack(self.k).cpu(), torch.stack(self.v).cpu()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _pools(gen: torch.Generator, device: str, dtype: torch.dtype) -> tuple[ToyPool, ToyPool]:
    k = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=gen).to(dtype)
    return ToyPool(k, v, "cpu"), ToyPool(k, v, device)


def check_pool_ops(device: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    inv_freq = default_inv_freq(DIM, THETA)
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        cpu, dev = _pools(gen, device, dtype)
        slots = torch.randperm(SLOTS, generator=gen)[:200]
        kv = torch.randn(LAYERS, 2, 200, HEADS, DIM, generator=gen).to(dtype)
        delta = torch.randint(-100_000, 100_000, (200,), generator=gen)
        src = kv.pin_memory() if device == "cuda" else kv
        backends = {
            "write": ops.write_pool_kv(dev, LAYERS, slots.to(device), src).backend,
            "rotate": ops.rotate_pool_keys(dev, LAYERS, slots, delta, inv_freq).backend,
        }
        ops.write_pool_kv(cpu, LAYERS, slots, kv)
        ops.rotate_pool_keys(cpu, LAYERS, slots, delta, inv_freq)
        read_dev = ops.read_pool_kv(dev, LAYERS, slots.to(device)).cpu()
        read_cpu = ops.read_pool_kv(cpu, LAYERS, slots)
        (ck, cv), (dk, dv) = cpu.snapshot(), dev.snapshot()
        # Rotation against sgl_pic.rope directly too: the CPU path is itself an op.
        want = rotate_layers(kv[:, 0].float(), delta, inv_freq).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        name = str(dtype).removeprefix("torch.")
        out[name] = {
            "backends": backends,
            "v_equal": bool(torch.equal(cv, dv)),
            "k_max_diff": _max_diff(ck, dk),
            "k_vs_rope_max_diff": _max_diff(dk[:, slots], want),
            "read_equal": bool(torch.equal(read_dev, read_cpu)),
            "ok": bool(
                torch.equal(cv, dv)
                and _max_diff(ck, dk) <= tol
                and _max_diff(dk[:, slots], want) <= tol
                and torch.equal(read_dev, read_cpu)
                and (device != "cuda" or set(backends.values()) == {"cuda"})
            ),
        }
    return {"ok": all(c["ok"] for c in out.values()), "cases": out}


def _store_and_placements(gen: torch.Generator) -> tuple[Any, list[Any], str, Any]:
    """A host store holding three chunks' pre-RoPE KV (pinned when CUDA is present), the
    server's placements of them in a prompt, the store's label, and the chunks
    (key, n, offset, recompute, k, v) for the reference."""
    from sgl_pic.store.loader import ChunkPlacement

    chunks = []  # (key, n, offset, recompute, k, v)
    offset = 5
    for i, n in enumerate((96, 40, 130)):
        k = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
        v = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
        recompute = torch.randperm(n, generator=gen)[: n // 5].sort().values
        chunks.append((f"{i:064x}", n, offset, recompute, k, v))
        offset += n + 3
    from sgl_pic.store.base import ChunkKV
    from sgl_pic.store.host import HostStore, HostStoreConfig

    digest = "ab" * 32
    store = HostStore(HostStoreConfig(1 << 30, pin_memory=True), digest)
    for key, n, _, _, k, v in chunks:
        store.put(ChunkKV(key, digest, tuple(range(n)), k, v, None))
    kind = "HostStore (pinned)" if torch.cuda.is_available() else "HostStore"
    placements = [
        ChunkPlacement(key, n, off, rec, tuple(range(n))) for key, n, off, rec, _, _ in chunks
    ]
    return store, placements, kind, chunks


def check_layer_feed(device: str) -> dict[str, Any]:
    from sgl_pic.engine.kv_access import KVAccess
    from sgl_pic.engine.layer_feed import CudaHandoff, LayerFeed
    from sgl_pic.engine.rotation import ModelRope
    from sgl_pic.store.loader import LoaderConfig, SparseLoader

    gen = torch.Generator().manual_seed(2)
    inv_freq = default_inv_freq(DIM, THETA)
    store, placements, kind, chunks = _store_and_placements(gen)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:400] + 1
    cpu, dev = _pools(gen, device, torch.float32)
    # Reference: the records rotated by hand into their slots.
    want_k, want_v = cpu.snapshot()
    for _, n, off, rec, k, v in chunks:
        keep = torch.ones(n, dtype=torch.bool)
        keep[rec] = False
        idx = keep.nonzero().flatten()
        dest = slots[off + idx]
        want_k[:, dest] = rotate_layers(k[:, idx], off + idx, inv_freq)
        want_v[:, dest] = v[:, idx]

    result: dict[str, Any] = {"store": kind}
    for name, pool, mode in (("cpu_inorder", cpu, "inorder"), (device, dev, "threaded")):
        loader = SparseLoader(store, inv_freq, LoaderConfig())
        kv = KVAccess(pool, LAYERS, ModelRope.plain(inv_freq))
        feed = LayerFeed(loader, placements, slots.to(device), kv, LAYERS, mode, timeout_s=60.0)
        handoff = feed._handoff
        t0 = time.perf_counter()
        feed.start()
        try:
            for layer in range(LAYERS):
                feed.before_layer(layer)
                if isinstance(handoff, CudaHandoff):
                    # The forward's stream must be ordered after the side stream's event.
                    torch.cuda.current_stream().synchronize()
                    assert handoff.events[layer].query(), f"event {layer} not done"
        finally:
            feed.close()
        wall = time.perf_counter() - t0
        got_k, got_v = pool.snapshot()
        k_diff, v_diff = _max_diff(got_k, want_k), _max_diff(got_v, want_v)
        result[name] = {
            "mode": mode,
            "handoff": type(handoff).__name__,
            "events": len(handoff.events) if isinstance(handoff, CudaHandoff) else 0,
            "side_stream": isinstance(handoff, CudaHandoff)
            and handoff.stream != torch.cuda.current_stream(),
            "bytes_moved": feed.bytes_moved,
            "wall_s": round(wall, 4),
            "k_max_diff": k_diff,
            "v_max_diff": v_diff,
            "ok": feed.done and k_diff <= 1e-4 and v_diff == 0.0,
        }
    if device == "cuda":
        result[device]["ok"] = result[device]["ok"] and result[device]["handoff"] == "CudaHandoff"
        result["no_host_sync"] = _feed_does_not_sync(store, placements, slots, inv_freq)
    ok = all(v["ok"] for v in result.values() if isinstance(v, dict))
    return {"ok": ok, **result}


def _feed_does_not_sync(
    store: Any,
    placements: list[Any],
    slots: torch.Tensor,  # [prompt] pool slots
    inv_freq: torch.Tensor,  # [DIM // 2]
) -> dict[str, Any]:
    """A long device sleep queued on the side stream before the last layer's copy:
    before_layer must return while it still runs (no host sync), and the rows the
    forward stream then writes must still be the loaded ones (it waited on the event)."""
    from sgl_pic.engine.kv_access import KVAccess
    from sgl_pic.engine.layer_feed import LayerFeed
    from sgl_pic.engine.rotation import ModelRope
    from sgl_pic.store.loader import LoaderConfig, SparseLoader

    class SlowLoader(SparseLoader):
        def fetch_layer(self, chunks, layer):  # noqa: ANN001, ANN201
            torch.cuda._sleep(400_000_000 if layer == LAYERS - 1 else 20_000_000)
            return super().fetch_layer(chunks, layer)

    gen = torch.Generator().manual_seed(3)
    cpu, dev = _pools(gen, "cuda", torch.float32)
    for pool, loader_cls, mode in ((cpu, SparseLoader, "inorder"), (dev, SlowLoader, "threaded")):
        loader = loader_cls(store, inv_freq, LoaderConfig())
        kv = KVAccess(pool, LAYERS, ModelRope.plain(inv_freq))
        feed = LayerFeed(loader, placements, slots.to(pool.k[0].device), kv, LAYERS, mode)
        feed.start()
        try:
            for layer in range(LAYERS):
                feed.before_layer(layer)
            pending = mode == "threaded" and not feed._handoff.events[LAYERS - 1].query()
        finally:
            feed.close()
        if mode == "threaded":
            last_pending = pending
    torch.cuda.synchronize()
    (ck, cv), (dk, dv) = cpu.snapshot(), dev.snapshot()
    ok = last_pending and _max_diff(ck, dk) <= 1e-4 and torch.equal(cv, dv)
    return {"ok": bool(ok), "last_event_pending_after_before_layer": bool(last_pending)}


def check_kv_access(device: str) -> dict[str, Any]:
    from sgl_pic.engine.kv_access import KVAccess
    from sgl_pic.engine.rotation import ModelRope

    gen = torch.Generator().manual_seed(4)
    inv_freq = default_inv_freq(DIM, THETA)
    cpu, dev = _pools(gen, device, torch.bfloat16)
    slots = torch.randperm(SLOTS, generator=gen)[:64]
    kv = torch.randn(LAYERS, 2, 64, HEADS, DIM, generator=gen)
    for pool in (cpu, dev):
        access = KVAccess(pool, LAYERS, ModelRope.plain(inv_freq))
        # write_rotated rotates the keys it is given in place: each pool gets its own copy.
        own = kv.to(pool.k[0].device, copy=True)
        access.write_rotated(slots.to(pool.k[0].device), own, start=1000)
        access.write_layer(2, slots[:8], kv[2, 0, :8], kv[2, 1, :8])
    (ck, cv), (dk, dv) = cpu.snapshot(), dev.snapshot()
    read = KVAccess(dev, LAYERS, ModelRope.plain(inv_freq)).read(slots.to(device)).cpu()
    return {
        "k_max_diff": _max_diff(ck, dk),
        "v_equal": bool(torch.equal(cv, dv)),
        "read_equal": bool(torch.equal(read[:, 0], dk[:, slots])),
        "ok": bool(_max_diff(ck, dk) <= 2e-2 and torch.equal(cv, dv)),
    }


CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "pool_ops": check_pool_ops,
    "layer_feed": check_layer_feed,
    "kv_access": check_kv_access,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU stands in for the GPU")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: $OUT if set")
    args = parser.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_dry_run:
        print("gpu_serving_ops: no CUDA device (torch.cuda.is_available() is False)")
        return 3
    device = "cuda" if has_cuda and not args.cpu_dry_run else "cpu"
    if device == "cuda":
        ops.prepare_cuda(torch.device("cuda"))  # as the server does at start-up
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_status": ops.cuda_status()._asdict() | {"library": str(ops.cuda_status().library)},
        "sglang_imported": False,
        "checks": {},
    }
    for name, check in CHECKS.items():
        t0 = time.perf_counter()
        try:
            res = check(device)
        except Exception as exc:  # noqa: BLE001 - reported, the other checks still run
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        res["seconds"] = round(time.perf_counter() - t0, 3)
        summary["checks"][name] = res
        print(f"{name:<12} {'OK' if res['ok'] else 'FAIL'}  ({res['seconds']} s)")
    summary["sglang_imported"] = "sglang" in sys.modules
    summary["ok"] = (
        all(c["ok"] for c in summary["checks"].values()) and not (summary["sglang_imported"])
    )
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    out_dir = args.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out_dir is None and args.cpu_dry_run:
        out_dir = Path(tempfile.gettempdir())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_serving_ops.json").write_text(text + "\n")
        print(f"wrote {out_dir / 'gpu_serving_ops.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
