"""Builds the kernel library of ``kernels/*.cu`` with nvcc into a cache directory.

The file name carries a hash of the sources, flags, archs and nvcc version, so a stale
library is never loaded. Ranks of one machine share the directory: a file lock lets one
of them build while the others wait and then load its file, and the build goes to a
temporary file renamed into place, so no process ever loads half a library. A failed
build leaves ``<library>.failed`` with its reason: the ranks that waited for it fail at
once with that reason instead of each running nvcc again (up to ``BUILD_TIMEOUT_S`` each).
A later start-up, which did not wait for that build, tries again (a timeout may not
recur), and changed sources or flags give a new file name, so they always build. Called
by ``sgl_pic.ops.cuda.prepare`` at start-up, never inside a forward.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path


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
BUILD_TIMEOUT_S = 600


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
    stale library is never loaded. Raises RuntimeError when nvcc fails, or when the build
    of the same inputs this process waited for failed (the module doc).
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH or at /usr/local/cuda/bin/nvcc")
    sources = sorted(kernel_dir.glob("*.cu"))
    if not sources:
        raise RuntimeError(f"no CUDA sources under {kernel_dir}")
    flags = nvcc_flags(kernel_dir)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in sorted(set(archs))]
    lib = out_dir / _library_name(nvcc, kernel_dir, sources, [*flags, *gencode])
    if lib.is_file():
        return lib

    out_dir.mkdir(parents=True, exist_ok=True)
    failed = out_dir / f"{lib.name}.failed"
    # A failure recorded before this process waits is an earlier start-up's: retried.
    seen = _read_failure(failed)
    # Ranks of one machine share the directory: one builds, the others wait and load it.
    with _file_lock(out_dir / f"{lib.name}.lock"):
        if lib.is_file():
            return lib
        failure = _read_failure(failed)
        if failure is not None and failure != seen:
            # The build this process waited for failed: the same inputs would fail again.
            raise RuntimeError(
                f"the kernel build failed in another process ({failed}):\n{failure[1]}"
            )
        cmd = [str(nvcc), *flags, *gencode, f"-I{kernel_dir}", "-shared", *map(str, sources)]
        _compile(cmd, lib, failed)
        failed.unlink(missing_ok=True)
    return lib


def _library_name(
    nvcc: Path, kernel_dir: Path, sources: Sequence[Path], options: Sequence[str]
) -> str:
    """The library's file name: a hash of every source and header under ``kernel_dir``
    (names and bytes), the nvcc ``options`` (flags, then gencode) and nvcc's version."""
    version = subprocess.run(
        [str(nvcc), "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    for path in sorted([*sources, *kernel_dir.glob("*.cuh"), *kernel_dir.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join([*options, version]).encode())
    return f"libsgl_pic_kernels-{digest.hexdigest()[:16]}.so"


def _compile(cmd: Sequence[str], lib: Path, failed: Path) -> None:
    """Runs nvcc ``cmd`` (all but its output) into a temporary file beside ``lib`` and
    renames it into place; called under the build lock. On any failure records it at
    ``failed`` (best effort) and re-raises; the temporary file never stays."""
    # Build beside the target and rename, so no process ever loads half a file.
    fd, tmp_name = tempfile.mkstemp(suffix=".so.tmp", dir=lib.parent)
    os.close(fd)
    cmd = [*cmd, "-o", tmp_name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(
                f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}"
            )
        os.replace(tmp_name, lib)
    except Exception as exc:
        with contextlib.suppress(OSError):  # the record only saves waiters time
            _write_failure(failed, str(exc))
        raise
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _read_failure(path: Path) -> tuple[str, str] | None:
    """(the failed build's id, its reason) from ``path``, or None when there is none."""
    try:
        token, _, reason = path.read_text().partition("\n")
    except FileNotFoundError:
        return None
    return token, reason


def _write_failure(path: Path, reason: str) -> None:
    """Records a failed build: a fresh id (so that a waiter tells it from a failure it saw
    before waiting) and the reason, renamed into place so no reader sees half of it."""
    fd, tmp_name = tempfile.mkstemp(suffix=".failed.tmp", dir=path.parent)
    with os.fdopen(fd, "w") as out:
        out.write(f"{uuid.uuid4().hex}\n{reason}")
    os.replace(tmp_name, path)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (and threads: each call opens its
    own descriptor); the kernel drops it if the holder dies. Waits are bounded by the
    holder's nvcc timeout."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
