"""Lazy loader of the CUDA kernels in ``kernels/`` and their launchers.

Nothing here runs at import. The first ``status()`` on a machine where torch sees a GPU
builds ``kernels/*.cu`` with nvcc for the visible devices' architectures into a cache
directory (once per source/flags/arch/nvcc combination; later processes reuse the
file), loads it with ctypes and checks its ABI version. Any failure is recorded in the
returned ``CudaStatus`` and the ops fall back to the torch reference.

The library takes raw pointers: launchers pass ``tensor.data_ptr()`` and the current
torch stream, so kernels are ordered with the surrounding torch work. It links CUDA's
runtime statically; both runtimes share the device's primary context, which is what
makes torch's pointers and streams valid in it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from sgl_pic.ops.validate import CopyPlan, Layers, RopePlan


def find_kernel_dir() -> Path:
    """Where the CUDA sources are: ``sgl_pic/kernels`` inside an installed package (the
    wheel ships them there, see pyproject.toml), else ``kernels/`` of the source checkout
    this module runs from."""
    here = Path(__file__).resolve()
    packaged = here.parents[1] / "kernels"
    if (packaged / "nvcc.flags").is_file():
        return packaged
    return here.parents[2] / "kernels"


KERNEL_DIR = find_kernel_dir()
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "sgl_pic" / "kernels"
ABI_VERSION = 1  # PIC_ABI_VERSION in kernels/sgl_pic_kernels.h
MAX_HEAD_DIM = 1024  # kMaxHeadDim in kernels/rope.cu
BUILD_TIMEOUT_S = 600

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LAYOUT_CODES = {"neox": 0, "interleaved": 1}


class CudaStatus(NamedTuple):
    """Whether the kernels can run, the library file, and why not when they can't."""

    available: bool
    library: Path | None
    reason: str


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: CudaStatus | None = None


def find_nvcc() -> Path | None:
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def nvcc_flags(kernel_dir: Path = KERNEL_DIR) -> list[str]:
    """The flags kernels/compile_check.sh uses too, from kernels/nvcc.flags."""
    lines = (kernel_dir / "nvcc.flags").read_text().splitlines()
    return [line.strip() for line in lines if line.strip()]


def build_library(
    out_dir: Path,
    archs: Sequence[str],
    nvcc: Path | None = None,
    kernel_dir: Path = KERNEL_DIR,
) -> Path:
    """Builds (or finds already built) the kernel library for ``archs`` ("80", "90").

    The file name carries a hash of the sources, flags, archs and nvcc version, so a
    stale library is never loaded. Raises RuntimeError when nvcc fails.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH or at /usr/local/cuda/bin/nvcc")
    sources = sorted(kernel_dir.glob("*.cu"))
    if not sources:
        raise RuntimeError(f"no CUDA sources under {kernel_dir}")
    flags = nvcc_flags(kernel_dir)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in sorted(set(archs))]
    version = subprocess.run(
        [str(nvcc), "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    for path in sorted([*sources, *kernel_dir.glob("*.cuh"), *kernel_dir.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join([*flags, *gencode, version]).encode())
    lib = out_dir / f"libsgl_pic_kernels-{digest.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib

    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent processes never load half a file.
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [str(nvcc), *flags, *gencode, f"-I{kernel_dir}", "-shared", *map(str, sources)]
    cmd += ["-o", tmp_name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(
                f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}"
            )
        os.replace(tmp_name, lib)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return lib


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pic_abi_version.argtypes = []
    lib.pic_abi_version.restype = ctypes.c_int
    lib.pic_error_string.argtypes = [ctypes.c_int]
    lib.pic_error_string.restype = ctypes.c_char_p
    lib.pic_copy_rows.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64]
    lib.pic_copy_rows.argtypes += [i64, ptr]
    lib.pic_copy_rows.restype = ctypes.c_int
    lib.pic_rope_rows.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.pic_rope_rows.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_float, i64, ptr]
    lib.pic_rope_rows.restype = ctypes.c_int


def open_library(path: Path) -> ctypes.CDLL:
    """Loads a built library and checks that it speaks this module's ABI."""
    lib = ctypes.CDLL(str(path))
    _bind(lib)
    version = lib.pic_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path} has kernel ABI {version}; this sgl_pic expects {ABI_VERSION}")
    return lib


def load(library: Path | None = None, cache_dir: Path = DEFAULT_CACHE_DIR) -> CudaStatus:
    """(Re)loads the kernels: ``library`` if given (e.g. from compile_check.sh), else the
    cached build for the visible GPUs, building it first when missing. Never raises."""
    global _lib, _status
    with _lock:
        _lib = None
        if not torch.cuda.is_available():
            _status = CudaStatus(False, library, "torch sees no CUDA device")
            return _status
        try:
            if library is None:
                if not KERNEL_DIR.is_dir():
                    raise RuntimeError(f"kernel sources not found at {KERNEL_DIR}")
                archs = {
                    "{}{}".format(*torch.cuda.get_device_capability(d))
                    for d in range(torch.cuda.device_count())
                }
                library = build_library(cache_dir, sorted(archs))
            _lib = open_library(library)
            _status = CudaStatus(True, library, "loaded")
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _status = CudaStatus(False, library, f"{type(exc).__name__}: {exc}")
        return _status


def status() -> CudaStatus:
    """The kernels' status, loading them on first call."""
    return _status if _status is not None else load()


def require() -> ctypes.CDLL:
    """The loaded library; RuntimeError with the reason when the kernels can't run."""
    state = status()
    if _lib is None:
        raise RuntimeError(f"sgl-pic CUDA kernels unavailable: {state.reason}")
    return _lib


def _alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (addresses and strides)."""
    align = 16
    for v in values:
        if v:
            align = min(align, v & -v)
    return align


_ptr_tables: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _layer_addressing(layers: Layers) -> tuple[int, int, int, list[int]]:
    """(base address, layer stride in bytes, pointer-table address or 0, all addresses
    for alignment). Separate per-layer tensors go through a device table of their
    addresses, cached because a KV pool keeps the same tensors for its whole life."""
    ptrs = [v.data_ptr() for v in layers.views]
    if layers.stacked is not None:
        stride = layers.stacked.stride(0) * layers.stacked.element_size()
        return ptrs[0], stride, 0, [ptrs[0], stride]
    key = (layers.device, tuple(ptrs))
    table = _ptr_tables.get(key)
    if table is None:
        if len(_ptr_tables) >= 64:
            _ptr_tables.clear()
        table = torch.tensor(ptrs, dtype=torch.int64, device=layers.device)
        _ptr_tables[key] = table
    return 0, 0, table.data_ptr(), ptrs


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: {lib.pic_error_string(code).decode()} (code {code})")


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


def run_copy(plan: CopyPlan) -> None:
    """Executes a validated copy plan (``can_copy(plan)``) on the current stream."""
    lib = require()
    n = plan.dst_ids.numel()
    if n == 0:
        return
    src = plan.src
    if src.stacked is None:  # validate builds sources from one tensor; keep that true
        raise ValueError("the source of a copy must be one stacked tensor")
    src_base = src.views[0].data_ptr()
    src_stride = src.stacked.stride(0) * src.stacked.element_size()
    dst_base, dst_stride, dst_table, dst_ptrs = _layer_addressing(plan.dst)
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


def run_rope(plan: RopePlan) -> None:
    """Executes a validated RoPE plan (``can_rope(plan)``) on the current stream."""
    lib = require()
    n = plan.positions.numel()
    if n == 0:
        return
    target = plan.target
    base, stride, table, ptrs = _layer_addressing(target)
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
