"""The public KV ops: checked at the boundary, then run by the CUDA kernels when the
tensors are on a GPU and the kernels load, else by the torch reference.

Each op returns ``OpResult``, naming the backend that ran it. All ops work in place on
the destination, on the current CUDA stream, and never write out of bounds: indices
out of range raise ValueError before anything runs. Slot indices must be distinct.
"""

from __future__ import annotations

import warnings

import torch

from sgl_pic.ops import cuda, reference
from sgl_pic.ops.kvops import Backend, KVOps, OpResult
from sgl_pic.ops.validate import CopyPlan, RopePlan

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    # Falling back is correct but slow; say so once per cause, not once per layer.
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cuda_ready(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    state = cuda.status()
    if not state.available:
        _warn_once(f"sgl_pic.ops: CUDA kernels unavailable, using torch: {state.reason}")
    return state.available


def copy_backend(plan: CopyPlan) -> Backend:
    """The backend a validated copy plan runs on."""
    if not _cuda_ready(plan.dst.device):
        return "reference"
    if not cuda.can_copy(plan):
        _warn_once("sgl_pic.ops: source on unpinned host memory; gathering through torch")
        return "reference"
    return "cuda"


def rope_backend(plan: RopePlan) -> Backend:
    """The backend a validated RoPE plan runs on."""
    if _cuda_ready(plan.target.device) and cuda.can_rope(plan):
        return "cuda"
    return "reference"


def _copy(plan: CopyPlan) -> OpResult:
    backend = copy_backend(plan)
    (cuda.run_copy if backend == "cuda" else reference.run_copy)(plan)
    return OpResult(backend)


def _rope(plan: RopePlan) -> OpResult:
    backend = rope_backend(plan)
    (cuda.run_rope if backend == "cuda" else reference.run_rope)(plan)
    return OpResult(backend)


# The public ops (``sgl_pic.ops.kvops``) bound to the backend-choosing runners above.
_OPS = KVOps(_copy, _rope)
gather_kv = _OPS.gather_kv
gather_kv_layer = _OPS.gather_kv_layer
scatter_kv = _OPS.scatter_kv
scatter_kv_layer = _OPS.scatter_kv_layer
apply_rope_kv = _OPS.apply_rope_kv
apply_rope_kv_layer = _OPS.apply_rope_kv_layer
rerotate_kv = _OPS.rerotate_kv
rerotate_kv_layer = _OPS.rerotate_kv_layer
