"""Launchers of the CUDA kernels: turn a validated plan into the raw pointers, strides
and alignment one kernel call takes, and make that call on the current torch stream.

Pure with respect to the process: a launcher changes only the plan's destination, and
raises ``KernelError`` when the kernel returns an error; deciding what a failure means
for the process (the kernels unavailable for good) is ``sgl_pic.ops.cuda``'s. Called on
the worker side, inside a forward, only once ``cuda.prepare`` loaded the library.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from types import MappingProxyType

import torch

from sgl_pic.ops.validate import CopyPlan, Layers, RopePlan

MAX_HEAD_DIM = 1024  # kMaxHeadDim in kernels/rope.cu

# Read-only: the codes of kernels/sgl_pic_kernels.h.
_DTYPE_CODES: Mapping[torch.dtype, int] = MappingProxyType(
    {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
)
_LAYOUT_CODES: Mapping[str, int] = MappingProxyType({"neox": 0, "interleaved": 1})


class KernelError(RuntimeError):
    """The kernels cannot run: unavailable, or a launch returned an error (which marks
    them unavailable for the rest of the process)."""


class PointerTables:
    """Device tables of per-layer tensor addresses, for kernels writing separate
    per-layer tensors. Cached because a KV pool keeps the same tensors for its whole
    life; bounded, as a table is cheap to rebuild. Owned by the loaded kernels
    (``sgl_pic.ops.cuda``); the launch test uses its own."""

    MAX_TABLES = 64

    def __init__(self) -> None:
        self._tables: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}

    def table(self, device: torch.device, ptrs: list[int]) -> torch.Tensor:
        """The int64 table of ``ptrs`` on ``device``, built on first use."""
        key = (device, tuple(ptrs))
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= self.MAX_TABLES:
                self._tables.clear()
            table = torch.tensor(ptrs, dtype=torch.int64, device=device)
            self._tables[key] = table
        return table


def _alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (addresses and strides)."""
    align = 16
    for v in values:
        if v:
            align = min(align, v & -v)
    return align


def _layer_addressing(layers: Layers, tables: PointerTables) -> tuple[int, int, int, list[int]]:
    """(base address, layer stride in bytes, pointer-table address or 0, all addresses
    for alignment). Separate per-layer tensors go through a device table of their
    addresses, taken from ``tables``."""
    ptrs = [v.data_ptr() for v in layers.views]
    if layers.stacked is not None:
        stride = layers.stacked.stride(0) * layers.stacked.element_size()
        return ptrs[0], stride, 0, [ptrs[0], stride]
    return 0, 0, tables.table(layers.device, ptrs).data_ptr(), ptrs


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise KernelError(f"{what}: {lib.pic_error_string(code).decode()} (code {code})")


def can_copy(plan: CopyPlan) -> bool:
    """True when the kernel can read the source: on the device, or pinned host memory
    (which the GPU reads directly)."""
    src_device = plan.src.device
    if plan.dst.device.type != "cuda":
        return False
    if src_device == plan.dst.device:
        return True
    return src_device.type == "cpu" and plan.src.views[0].is_pinned()


def can_rope(plan: RopePlan) -> bool:
    """True for CUDA targets the kernel handles: head_dim up to MAX_HEAD_DIM, and (for
    the interleaved layout) every address aligned to a pair of elements."""
    target = plan.target
    _, head_dim = target.row_shape
    if target.device.type != "cuda" or head_dim > MAX_HEAD_DIM:
        return False
    addresses = [v.data_ptr() for v in target.views]
    pair = 2 * target.views[0].element_size() if plan.layout == "interleaved" else 1
    return _alignment(*addresses) >= min(pair, 16)


def launch_copy(lib: ctypes.CDLL, plan: CopyPlan, tables: PointerTables) -> None:
    """Runs ``pic_copy_rows`` for ``plan`` on the current stream of its destination's
    device; KernelError when the kernel returns an error."""
    n = plan.dst_ids.numel()
    if n == 0:
        return
    src = plan.src
    if src.stacked is None:  # validate builds sources from one tensor; keep that true
        raise ValueError("the source of a copy must be one stacked tensor")
    src_base = src.views[0].data_ptr()
    src_stride = src.stacked.stride(0) * src.stacked.element_size()
    dst_base, dst_stride, dst_table, dst_ptrs = _layer_addressing(plan.dst, tables)
    heads, head_dim = plan.dst.row_shape
    row_bytes = heads * head_dim * plan.dst.views[0].element_size()
    device = plan.dst.device
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        code = lib.pic_copy_rows(
            src_base,
            src_stride,
            src.num_rows,
            0 if plan.src_ids is None else plan.src_ids.data_ptr(),
            dst_base,
            dst_stride,
            dst_table,
            plan.dst.num_rows,
            plan.dst_ids.data_ptr(),
            n,
            plan.dst.num_layers,
            row_bytes,
            _alignment(src_base, src_stride, dst_stride, *dst_ptrs),
            stream,
        )
    _check(lib, code, "pic_copy_rows")


def launch_rope(lib: ctypes.CDLL, plan: RopePlan, tables: PointerTables) -> None:
    """Runs ``pic_rope_rows`` for ``plan`` on the current stream of its target's device;
    KernelError when the kernel returns an error."""
    n = plan.positions.numel()
    if n == 0:
        return
    target = plan.target
    base, stride, table, ptrs = _layer_addressing(target, tables)
    heads, head_dim = target.row_shape
    device = target.device
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        code = lib.pic_rope_rows(
            base,
            stride,
            table,
            target.num_layers,
            target.num_rows,
            0 if plan.row_ids is None else plan.row_ids.data_ptr(),
            n,
            plan.positions.data_ptr(),
            0 if plan.old_positions is None else plan.old_positions.data_ptr(),
            plan.inv_freq.data_ptr(),
            heads,
            head_dim,
            _DTYPE_CODES[target.dtype],
            _LAYOUT_CODES[plan.layout],
            plan.scale,
            _alignment(*ptrs, stride),
            stream,
        )
    _check(lib, code, "pic_rope_rows")
