"""Building the kernel library into a cache directory that several ranks share, with
nvcc faked by a script that writes its output slowly: one process builds, the others
wait and load its file, and no one ever sees half a library."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest

from sgl_pic.ops.cuda_build import build_library

HALF = 4096  # bytes the fake nvcc writes before and after its pause


def _fake_nvcc(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    """(nvcc, log): each build appends a line to log and writes its output in two halves
    a second apart, so a reader of an unfinished file would see one half."""
    log = tmp_path / "nvcc.log"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        "if '--version' in sys.argv:\n"
        "    print('Cuda compilation tools, release 12.4 (fake)')\n"
        "    sys.exit(0)\n"
        f"open({str(log)!r}, 'a').write('build\\n')\n"
        f"if {fail!r}:\n"
        "    sys.exit('nvcc fatal: unsupported gpu architecture')\n"
        "with open(sys.argv[sys.argv.index('-o') + 1], 'wb') as out:\n"
        f"    out.write(b'A' * {HALF})\n"
        "    out.flush()\n"
        "    time.sleep(1.0)\n"
        f"    out.write(b'B' * {HALF})\n"
    )
    nvcc.chmod(0o755)
    return nvcc, log


def _kernel_dir(tmp_path: Path) -> Path:
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "nvcc.flags").write_text("-O3\n--std=c++17\n")
    (kernels / "copy.cu").write_text("// a kernel\n")
    return kernels


def _build_in_child(barrier: Any, results: Any, out_dir: Path, nvcc: Path, kernels: Path):
    barrier.wait()  # every rank reaches the empty cache at once
    try:
        lib = build_library(out_dir, ["90"], nvcc=nvcc, kernel_dir=kernels)
        results.put(("ok", str(lib), lib.read_bytes()))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", repr(exc), b""))


def test_ranks_sharing_a_cache_build_once(tmp_path: Path) -> None:
    nvcc, log = _fake_nvcc(tmp_path)
    kernels, out_dir = _kernel_dir(tmp_path), tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")
    ranks = 3
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(target=_build_in_child, args=(barrier, results, out_dir, nvcc, kernels))
        for _ in range(ranks)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert {status for status, _, _ in got} == {"ok"}, got
    assert len({path for _, path, _ in got}) == 1
    whole = b"A" * HALF + b"B" * HALF
    assert all(data == whole for _, _, data in got)  # each read a finished library
    assert log.read_text().count("build") == 1  # one nvcc run, not one per rank
    lib = Path(got[0][1])
    assert sorted(p.name for p in out_dir.iterdir()) == [lib.name, f"{lib.name}.lock"]


def test_a_failed_build_leaves_nothing_and_the_next_one_runs(tmp_path: Path) -> None:
    nvcc, log = _fake_nvcc(tmp_path, fail=True)
    kernels, out_dir = _kernel_dir(tmp_path), tmp_path / "cache"
    with pytest.raises(RuntimeError, match="unsupported gpu architecture"):
        build_library(out_dir, ["90"], nvcc=nvcc, kernel_dir=kernels)
    assert [p.suffix for p in out_dir.iterdir()] == [".lock"]  # no half-built library
    with pytest.raises(RuntimeError):
        build_library(out_dir, ["90"], nvcc=nvcc, kernel_dir=kernels)  # lock was released
    assert log.read_text().count("build") == 2
