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
makes torch's pointers and streams valid in it. The launchers are
``sgl_pic.ops.cuda_launch``, the launch test ``sgl_pic.ops.cuda_selftest``; this module
owns what the process keeps about the kernels (``_Kernels``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from sgl_pic.ops.cuda_build import DEFAULT_CACHE_DIR as DEFAULT_CACHE_DIR
from sgl_pic.ops.cuda_build import KERNEL_DIR as KERNEL_DIR
from sgl_pic.ops.cuda_build import build_library as build_library
from sgl_pic.ops.cuda_build import find_nvcc as find_nvcc
from sgl_pic.ops.cuda_build import nvcc_flags as nvcc_flags
from sgl_pic.ops.cuda_launch import MAX_HEAD_DIM as MAX_HEAD_DIM
from sgl_pic.ops.cuda_launch import KernelError as KernelError
from sgl_pic.ops.cuda_launch import PointerTables, launch_copy, launch_rope
from sgl_pic.ops.cuda_launch import can_copy as can_copy
from sgl_pic.ops.cuda_launch import can_rope as can_rope
from sgl_pic.ops.cuda_selftest import launch_test as launch_test
from sgl_pic.ops.validate import CopyPlan, RopePlan

logger = logging.getLogger(__name__)


ABI_VERSION = 1  # PIC_ABI_VERSION in kernels/sgl_pic_kernels.h


class CudaStatus(NamedTuple):
    """Whether the kernels can run, the library file, and why not when they can't."""

    available: bool
    library: Path | None
    reason: str


class _Kernels:
    """The process's kernel library: its status, the loaded library and the devices its
    launch test passed on (changed only under ``lock``, by ``prepare``, ``load`` and a
    failed launch); the pointer tables its launchers reuse; the fallback warnings the
    ops already logged (``warn_once``).

    One per process, by design: the library is loaded into the process (ctypes), its
    status is a fact of the process's GPUs, and ops run in hot paths that hold no
    handle to pass it down. Everything the kernels keep is here, so a test replaces it
    whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.status: CudaStatus | None = None  # None until prepared
        self.tested: set[torch.device] = set()
        self.tables = PointerTables()
        self.warned: set[str] = set()


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


def run_copy(plan: CopyPlan) -> None:
    """Executes a validated copy plan (``can_copy(plan)``) on the current stream.
    KernelError when the kernels are unavailable or the launch fails (which marks them
    unavailable); the destination is then unchanged."""
    lib = require()
    try:
        launch_copy(lib, plan, _KERNELS.tables)
    except KernelError as exc:
        _fail(str(exc))
        raise


def run_rope(plan: RopePlan) -> None:
    """Executes a validated RoPE plan (``can_rope(plan)``) on the current stream, like
    ``run_copy``."""
    lib = require()
    try:
        launch_rope(lib, plan, _KERNELS.tables)
    except KernelError as exc:
        _fail(str(exc))
        raise


def warn_once(message: str) -> None:
    """Logs ``message`` as a warning the first time this process sees it (a fallback to
    torch is correct but slow; say so once per cause, not once per layer)."""
    warned = _KERNELS.warned
    if message not in warned:
        warned.add(message)
        logger.warning(message)
