"""The public KV ops: checked at the boundary, then run by the CUDA kernels when the
tensors are on a GPU and the kernels were prepared (``sgl_pic.ops.cuda.prepare``, at
start-up), else by the torch reference. Nothing here builds or loads kernels.

Each op returns ``OpResult``, naming the backend that ran it. All ops work in place on
the destination, on the current CUDA stream, and never write out of bounds: indices
out of range raise ValueError before anything runs. Slot indices must be distinct. A
kernel launch that fails marks the kernels unavailable (once, logged) and the op runs
by the reference instead; later ops go straight to the reference.
"""

from __future__ import annotations

from sgl_pic.ops import cuda, reference
from sgl_pic.ops.kvops import Backend, KVOps, OpResult
from sgl_pic.ops.validate import CopyPlan, RopePlan


def _kernels_ready() -> bool:
    state = cuda.status()  # reads the recorded status: never builds inside a forward
    if not state.available:
        cuda.warn_once(
            f"sgl_pic.ops: CUDA kernels unavailable, GPU KV ops run in torch: {state.reason}"
        )
    return state.available


def copy_backend(plan: CopyPlan) -> Backend:
    """The backend a validated copy plan runs on."""
    if not cuda.can_copy(plan):  # a CPU destination, or a source the GPU cannot read
        if plan.dst.device.type == "cuda" and _kernels_ready():
            cuda.warn_once("sgl_pic.ops: source on unpinned host memory; gathering through torch")
        return "reference"
    return "cuda" if _kernels_ready() else "reference"


def rope_backend(plan: RopePlan) -> Backend:
    """The backend a validated RoPE plan runs on."""
    return "cuda" if cuda.can_rope(plan) and _kernels_ready() else "reference"


def _copy(plan: CopyPlan) -> OpResult:
    if copy_backend(plan) == "cuda":
        try:
            cuda.run_copy(plan)
            return OpResult("cuda")
        except cuda.KernelError:
            pass  # nothing was written; ``cuda`` marked the kernels unavailable and logged
    reference.run_copy(plan)
    return OpResult("reference")


def _rope(plan: RopePlan) -> OpResult:
    if rope_backend(plan) == "cuda":
        try:
            cuda.run_rope(plan)
            return OpResult("cuda")
        except cuda.KernelError:
            pass  # as in _copy
    reference.run_rope(plan)
    return OpResult("reference")


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
