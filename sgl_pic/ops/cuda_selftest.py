"""The launch test of the CUDA kernels: each kernel run once on a device, on a few rows,
against the torch reference. ``sgl_pic.ops.cuda`` runs it at start-up (worker side,
before serving) and trusts the kernels only once it passed.
"""

from __future__ import annotations

import ctypes

import torch

from sgl_pic.ops import reference
from sgl_pic.ops.cuda_launch import KernelError, PointerTables, launch_copy, launch_rope
from sgl_pic.ops.validate import layers_of, plan_gather, plan_rope
from sgl_pic.rope import default_inv_freq


def launch_test(lib: ctypes.CDLL, device: torch.device) -> None:
    """Runs each kernel of ``lib`` once on ``device`` on a few rows (copies into a stacked
    buffer and into per-layer tensors; deferred RoPE and re-rotation, one per layout) and
    compares with the torch reference. Raises KernelError for a launch error or a wrong
    result (torch's own error for a fault found at the sync). Changes nothing outside
    its own tensors; takes a few milliseconds."""
    g = torch.Generator().manual_seed(0)
    tables = PointerTables()  # its tensors die with the test; keep their tables apart

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    src = rand(2, 8, 2, 64, dtype=torch.bfloat16)  # [num_layers, rows, heads, head_dim]
    pool = rand(2, 16, 2, 64, dtype=torch.bfloat16)
    tokens = torch.tensor([5, 0, 7], device=device)
    slots = torch.tensor([3, 15, 8], device=device)
    for name, dst in (("stacked", pool.clone()), ("per-layer", list(pool.clone().unbind(0)))):
        want = pool.clone()
        reference.run_copy(plan_gather(src, tokens, want, slots))
        launch_copy(lib, plan_gather(src, tokens, dst, slots), tables)
        torch.cuda.synchronize(device)
        got = dst if isinstance(dst, torch.Tensor) else torch.stack(dst)
        if not torch.equal(got, want):
            raise KernelError(f"pic_copy_rows ({name}) disagrees with the torch reference")

    keys = rand(2, 16, 2, 64, dtype=torch.float32)  # [num_layers, rows, heads, head_dim]
    inv_freq = default_inv_freq(64, 1e4, device=device)
    positions = torch.tensor([3, 70000, 9], device=device)
    old = torch.tensor([100, 2, 9], device=device)
    for layout, old_positions, scale in (("neox", None, 0.9), ("interleaved", old, 1.0)):
        want, got = keys.clone(), keys.clone()
        runs = ((want, reference.run_rope), (got, lambda p: launch_rope(lib, p, tables)))
        for out, run in runs:
            target = layers_of(out, "keys")
            run(plan_rope(target, positions, old_positions, inv_freq, layout, scale, slots))
        torch.cuda.synchronize(device)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise KernelError(f"pic_rope_rows ({layout}) disagrees with the torch reference")
