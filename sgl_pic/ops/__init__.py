"""KV-cache kernels of position-independent reuse: sparse gather of a cached chunk's
reused tokens into pool slots, scatter of recomputed rows, deferred RoPE and RoPE
re-rotation, each for all layers or one; and the same over an SGLang token pool
(``get_key_buffer`` / ``get_value_buffer``): read slots into a
# [num_layers, 2, n, num_kv_heads, head_dim] tensor, write one in, rotate keys in place.

CUDA kernels (``kernels/``) run when the tensors are on a GPU and ``prepare_cuda(device)``
built, loaded and launch-tested them at start-up (``cuda_status()`` says why not); the
torch reference (``sgl_pic.ops.reference``) runs otherwise. Importing this package, and
running any op, builds and loads nothing.
"""

from sgl_pic.ops.cuda import CudaStatus
from sgl_pic.ops.cuda import prepare as prepare_cuda
from sgl_pic.ops.cuda import status as cuda_status
from sgl_pic.ops.dispatch import (
    apply_rope_kv,
    apply_rope_kv_layer,
    gather_kv,
    gather_kv_layer,
    rerotate_kv,
    rerotate_kv_layer,
    scatter_kv,
    scatter_kv_layer,
)
from sgl_pic.ops.kvops import Backend, OpResult
from sgl_pic.ops.pool import (
    KVPool,
    pool_buffers,
    read_pool_kv,
    rotate_pool_keys,
    rotated_keys,
    write_pool_kv,
)
from sgl_pic.ops.validate import KVBuffer

__all__ = [
    "Backend",
    "CudaStatus",
    "KVBuffer",
    "KVPool",
    "OpResult",
    "apply_rope_kv",
    "apply_rope_kv_layer",
    "cuda_status",
    "gather_kv",
    "gather_kv_layer",
    "pool_buffers",
    "prepare_cuda",
    "read_pool_kv",
    "rerotate_kv",
    "rerotate_kv_layer",
    "rotate_pool_keys",
    "rotated_keys",
    "scatter_kv",
    "scatter_kv_layer",
    "write_pool_kv",
]
