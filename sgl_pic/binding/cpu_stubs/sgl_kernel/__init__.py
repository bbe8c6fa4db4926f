"""Plain-torch CPU stand-in for the ``sgl_kernel`` ops that SGLang's CPU path calls.

Anything not implemented here resolves to a function that raises NotImplementedError naming
the op: importing it is harmless (SGLang imports many ops it never calls on the CPU), calling
it is loud.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+sgl_pic_cpu_stub"


def _row_view(ptr: int, stride_bytes: int, rows: int) -> torch.Tensor:
    """A uint8 [rows, stride_bytes] view of memory SGLang owns (a KV buffer on the CPU)."""
    buf = (ctypes.c_char * (stride_bytes * rows)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [n_buffers] uint64 base address of each layer's K or V buffer
    strides: torch.Tensor,  # [n_buffers] bytes per slot row of each buffer
    tgt_loc: torch.Tensor,  # [n] slot indices to write
    src_loc: torch.Tensor,  # [n] slot indices to read
) -> None:
    """buf[tgt_loc] = buf[src_loc] for every buffer, as the CUDA kernel does."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        view = _row_view(int(ptr), int(stride), rows)
        # index_select copies first, so overlapping src/tgt sets behave like the kernel's
        # gather-then-scatter.
        view[tgt] = view.index_select(0, src)


def _missing(name: str) -> Callable[..., Any]:
    def op(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by sgl_pic's CPU stand-in "
            "(sgl_pic/binding/cpu_stubs/sgl_kernel); add a plain-torch version there"
        )

    op.__name__ = name
    return op


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
