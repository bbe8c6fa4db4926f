"""Loader of the CUDA kernels in ``kernels/`` and their launchers.

Nothing here runs at import, and nothing here builds inside a forward. ``prepare(device)``
is the one entry that builds: called once per process at start-up (worker side, before
serving), it builds ``kernels/*.cu`` with nvcc for the visible devices' architectures
(``sgl_pic.ops.cuda_build``: once per machine and source/flags/arch/nvcc combination,
into a cache directory later processes reuse), loads it with ctypes, checks its ABI
version and runs each kernel once on the device against the torch reference. Any
failure (build, load, ABI, launch error, wrong result), there or at a later launch,
marks the kernels unavailable once, with the reason kept in ``status()``; the ops then
run the torch reference and never try the kernels again.

The library takes raw pointers: launchers pass ``tensor.data_ptr()`` and the current
torch stream, so kernels are ordered with the surrounding torch work. It links CUDA's
runtime statically; both runtimes share the device's primary context, which is what
makes torch's pointers and streams valid in it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from sgl_pic.ops import reference
from sgl_pic.ops.cuda_build import DEFAULT_CACHE_DIR as DEFAULT_CACHE_DIR
from sgl_pic.ops.cuda_build import KERNEL_DIR as KERNEL_DIR
from sgl_pic.ops.cuda_build import build_library as build_library
from sgl_pic.ops.cuda_build import find_nvcc as find_nvcc
from sgl_pic.ops.cuda_build import nvcc_flags as nvcc_flags
from sgl_pic.ops.validate import CopyPlan, Layers, RopePlan, layers_of, plan_gather, plan_rope
from sgl_pic.rope import default_inv_freq

logger = logging.getLogger(__name__)


ABI_VERSION = 1  # PIC_ABI_VERSION in kernels/sgl_pic_kernels.h
MAX_HEAD_DIM = 1024  # kMaxHeadDim in kernels/rope.cu

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LAYOUT_CODES = {"neox": 0, "interleaved": 1}


class CudaStatus(NamedTuple):
    """Whether the kernels can run, the library file, and why not when they can't."""

    available: bool
    library: Path | None
    reason: str


class KernelError(RuntimeError):
    """The kernels cannot run: unavailable, or a launch returned an error (which marks
    them unavailable for the rest of the process)."""


class _Kernels:
    """The process's kernel library: its status, the loaded library and the devices its
    launch test passed on. Changed only under ``lock``, by ``prepare``, ``load`` and a
    failed launch."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.status: CudaStatus | None = None  # None until prepared
        self.tested: set[torch.device] = set()


_KERNELS = _Kernels()


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


def _visible_archs() -> list[str]:
    return sorted(
        {
            "{}{}".format(*torch.cuda.get_device_capability(d))
            for d in range(torch.cuda.device_count())
        }
    )


def _fail_locked(library: Path | None, reason: str) -> CudaStatus:
    """Marks the kernels unavailable for good (holding ``_KERNELS.lock``) and says why, in
    one line: called once per process, as nothing retries them afterwards."""
    _KERNELS.lib = None
    _KERNELS.tested.clear()
    _KERNELS.status = CudaStatus(False, library, reason)
    logger.warning("sgl_pic: CUDA kernels unavailable, KV ops run in torch: %s", reason)
    return _KERNELS.status


def _load_locked(library: Path | None, cache_dir: Path) -> ctypes.CDLL | None:
    """Builds (when ``library`` is None) and opens the library, holding the lock; the
    kernels stay unavailable until ``_ready_locked`` has tested them. None, with the
    failure recorded, when it cannot be loaded."""
    _KERNELS.lib = None
    _KERNELS.tested.clear()
    _KERNELS.status = None
    if not torch.cuda.is_available():
        _fail_locked(library, "torch sees no CUDA device")
        return None
    try:
        if library is None:
            if not KERNEL_DIR.is_dir():
                raise RuntimeError(f"kernel sources not found at {KERNEL_DIR}")
            library = build_library(cache_dir, _visible_archs())
        lib = open_library(library)
    except Exception as exc:  # noqa: BLE001 - any failure leaves torch serving
        _fail_locked(library, f"{type(exc).__name__}: {exc}")
        return None
    _KERNELS.status = CudaStatus(False, library, "loaded, launch test not run yet")
    return lib


def _ready_locked(lib: ctypes.CDLL, device: torch.device) -> CudaStatus:
    """Runs ``launch_test`` of ``lib`` on ``device``, holding the lock; the kernels are
    available once it passes, unavailable for good when it fails."""
    state = _KERNELS.status
    library = None if state is None else state.library
    try:
        with torch.cuda.device(device):
            launch_test(lib, device)
    except Exception as exc:  # noqa: BLE001 - build, ABI or driver: never trust them
        return _fail_locked(library, f"launch test on {device}: {type(exc).__name__}: {exc}")
    _KERNELS.tested.add(device)
    tested = ", ".join(sorted(str(d) for d in _KERNELS.tested))
    _KERNELS.status = CudaStatus(True, library, f"loaded; launch test passed on {tested}")
    _KERNELS.lib = lib
    logger.info("sgl_pic: CUDA kernels ready on %s (%s)", device, library)
    return _KERNELS.status


def prepare(device: torch.device) -> CudaStatus:
    """Makes the kernels ready for ``device`` or marks them unavailable; never raises.

    Called at start-up, worker side, once per process before the first forward (ops never
    build): on a CUDA device it builds or finds the library, loads it and runs
    ``launch_test`` there. Later calls return the recorded status, running the launch
    test once more only for a device not yet tested; a failure is final for the process.
    A non-CUDA device gets an unavailable status and builds nothing."""
    device = torch.device(device)
    if device.type != "cuda":
        return CudaStatus(False, None, f"{device} is not a CUDA device; nothing built")
    with _KERNELS.lock:
        lib = _KERNELS.lib
        if _KERNELS.status is None:
            lib = _load_locked(None, DEFAULT_CACHE_DIR)
        if lib is None:
            assert _KERNELS.status is not None
            return _KERNELS.status
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device in _KERNELS.tested and _KERNELS.status is not None:
            return _KERNELS.status
        return _ready_locked(lib, device)


def load(library: Path | None = None, cache_dir: Path = DEFAULT_CACHE_DIR) -> CudaStatus:
    """Reloads the kernels for tools (e.g. compile_check.sh's ``library``; else the cached
    build for the visible GPUs, building it when missing), forgetting any earlier status,
    and runs ``launch_test`` on the current CUDA device. Never raises."""
    with _KERNELS.lock:
        lib = _load_locked(library, cache_dir)
        if lib is None:
            assert _KERNELS.status is not None
            return _KERNELS.status
        return _ready_locked(lib, torch.device("cuda", torch.cuda.current_device()))


def status() -> CudaStatus:
    """The kernels' status; builds and loads nothing. Before ``prepare``, unavailable."""
    state = _KERNELS.status
    if state is not None:
        return state
    if not torch.cuda.is_available():
        return CudaStatus(False, None, "torch sees no CUDA device")
    return CudaStatus(False, None, "not prepared: sgl_pic.ops.cuda.prepare(device) not called")


def require() -> ctypes.CDLL:
    """The loaded library; KernelError with the reason when the kernels can't run."""
    lib = _KERNELS.lib
    if lib is None:
        raise KernelError(f"sgl-pic CUDA kernels unavailable: {status().reason}")
    return lib


def _fail(reason: str) -> None:
    """A launch failed in service: the kernels are unavailable from now on."""
    with _KERNELS.lock:
        state = _KERNELS.status
        if state is not None and state.available:
            _fail_locked(state.library, reason)


def launch_test(lib: ctypes.CDLL, device: torch.device) -> None:
    """Runs each kernel of ``lib`` once on ``device`` on a few rows (copies into a stacked
    buffer and into per-layer tensors; deferred RoPE and re-rotation, one per layout) and
    compares with the torch reference. Raises KernelError for a launch error or a wrong
    result (torch's own error for a fault found at the sync). Changes nothing outside
    its own tensors; takes a few milliseconds."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    src = rand(2, 8, 2, 64, dtype=torch.bfloat16)  # [num_layers, rows, heads, head_dim]
    pool = rand(2, 16, 2, 64, dtype=torch.bfloat16)
    tokens = torch.tensor([5, 0, 7], device=device)
    slots = torch.tensor([3, 15, 8], device=device)
    for name, dst in (("stacked", pool.clone()), ("per-layer", list(pool.clone().unbind(0)))):
        want = pool.clone()
        reference.run_copy(plan_gather(src, tokens, want, slots))
        _launch_copy(lib, plan_gather(src, tokens, dst, slots))
        torch.cuda.synchronize(device)
        got = dst if isinstance(dst, torch.Tensor) else torch.stack(dst)
        if not torch.equal(got, want):
            raise KernelError(f"pic_copy_rows ({name}) disagrees with the torch reference")

    keys = rand(2, 16, 2, 64, dtype=torch.float32)
    inv_freq = default_inv_freq(64, 1e4, device=device)
    positions = torch.tensor([3, 70000, 9], device=device)
    old = torch.tensor([100, 2, 9], device=device)
    for layout, old_positions, scale in (("neox", None, 0.9), ("interleaved", old, 1.0)):
        want, got = keys.clone(), keys.clone()
        for out, run in ((want, reference.run_rope), (got, lambda p: _launch_rope(lib, p))):
            target = layers_of(out, "keys")
            run(plan_rope(target, positions, old_positions, inv_freq, layout, scale, slots))
        torch.cuda.synchronize(device)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise KernelError(f"pic_rope_rows ({layout}) disagrees with the torch reference")


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


def run_copy(plan: CopyPlan) -> None:
    """Executes a validated copy plan (``can_copy(plan)``) on the current stream.
    KernelError when the kernels are unavailable or the launch fails (which marks them
    unavailable); the destination is then unchanged."""
    lib = require()
    try:
        _launch_copy(lib, plan)
    except KernelError as exc:
        _fail(str(exc))
        raise


def run_rope(plan: RopePlan) -> None:
    """Executes a validated RoPE plan (``can_rope(plan)``) on the current stream, like
    ``run_copy``."""
    lib = require()
    try:
        _launch_rope(lib, plan)
    except KernelError as exc:
        _fail(str(exc))
        raise


def _launch_copy(lib: ctypes.CDLL, plan: CopyPlan) -> None:
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


def _launch_rope(lib: ctypes.CDLL, plan: RopePlan) -> None:
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
