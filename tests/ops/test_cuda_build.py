"""Building the kernel library into a cache directory that several ranks share, with
nvcc faked by a script that writes its output slowly: one process builds, the others
wait and load its file, and no one ever sees half a library. When that build fails, the
waiting ranks fail with its reason instead of running nvcc again."""

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
    a second apart, so a reader of an unfinished file would see one half. It fails, after
    a second, when ``fail`` or when a source says "broken"."""
    log = tmp_path / "nvcc.log"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        "if '--version' in sys.argv:\n"
        "    print('Cuda compilation tools, release 12.4 (fake)')\n"
        "    sys.exit(0)\n"
        f"open({str(log)!r}, 'a').write('build\\n')\n"
        "broken = any('broken' in open(a).read() for a in sys.argv if a.endswith('.cu'))\n"
        f"if {fail!r} or broken:\n"
        "    time.sleep(1.0)  # long enough for the other ranks to be waiting\n"
        "    sys.exit('nvcc fatal: unsupported gpu architecture')\n"
        "with open(sys.argv[sys.argv.index('-o') + 1], 'wb') as out:\n"
        f"    out.write(b'A' * {HALF})\n"
        "    out.flush()\n"
        "    time.sleep(1.0)\n"
        f"    out.write(b'B' * {HALF})\n"
    )
    nvcc.chmod(0o755)
    return nvcc, log


def _kernel_dir(tmp_path: Path, source: str = "// a kernel\n") -> Path:
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "nvcc.flags").write_text("-O3\n--std=c++17\n")
    (kernels / "copy.cu").write_text(source)
    return kernels


def _build_in_child(barrier: Any, results: Any, out_dir: Path, nvcc: Path, kernels: Path) -> None:
    barrier.wait()  # every rank reaches the empty cache at once
    try:
        lib = build_library(out_dir, ["90"], nvcc=nvcc, kernel_dir=kernels)
        results.put(("ok", str(lib), lib.read_bytes()))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", repr(exc), b""))


def _run_ranks(ranks: int, out_dir: Path, nvcc: Path, kernels: Path) -> list[Any]:
    """Each rank's (status, library path or error, library bytes), all started at once."""
    ctx = multiprocessing.get_context("fork")
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
    return got


def test_ranks_sharing_a_cache_build_once(tmp_path: Path) -> None:
    nvcc, log = _fake_nvcc(tmp_path)
    kernels, out_dir = _kernel_dir(tmp_path), tmp_path / "cache"
    got = _run_ranks(3, out_dir, nvcc, kernels)
    assert {status for status, _, _ in got} == {"ok"}, got
    assert len({path for _, path, _ in got}) == 1
    whole = b"A" * HALF + b"B" * HALF
    assert all(data == whole for _, _, data in got)  # each read a finished library
    assert log.read_text().count("build") == 1  # one nvcc run, not one per rank
    lib = Path(got[0][1])
    assert sorted(p.name for p in out_dir.iterdir()) == [lib.name, f"{lib.name}.lock"]


def test_ranks_waiting_for_a_failed_build_fail_with_its_reason(tmp_path: Path) -> None:
    """One nvcc run for all ranks, however it ends: the waiters read its reason."""
    nvcc, log = _fake_nvcc(tmp_path)
    kernels, out_dir = _kernel_dir(tmp_path, "// broken\n"), tmp_path / "cache"
    got = _run_ranks(3, out_dir, nvcc, kernels)
    assert {status for status, _, _ in got} == {"error"}, got
    assert all("unsupported gpu architecture" in error for _, error, _ in got)
    assert sum("another process" in error for _, error, _ in got) == 2
    assert log.read_text().count("build") == 1  # not rerun by the ranks that waited
    failed = [p for p in out_dir.iterdir() if p.suffix == ".failed"]
    assert len(failed) == 1 and "unsupported gpu architecture" in failed[0].read_text()
    # Fixed sources hash to a fresh library name: they build, whatever failed before.
    (kernels / "copy.cu").write_text("// fixed\n")
    got = _run_ranks(3, out_dir, nvcc, kernels)
    assert {status for status, _, _ in got} == {"ok"}, got
    assert log.read_text().count("build") == 2


def test_a_failed_build_leaves_no_library_and_a_later_start_up_retries(tmp_path: Path) -> None:
    nvcc, log = _fake_nvcc(tmp_path, fail=True)
    kernels, out_dir = _kernel_dir(tmp_path), tmp_path / "cache"
    with pytest.raises(RuntimeError, match="unsupported gpu architecture"):
        build_library(out_dir, ["90"], nvcc=nvcc, kernel_dir=kernels)
    assert sorted(p.suffix for p in out_dir.iterdir()) == [".failed", ".lock"]  # no .so
    # A call that did not wait for that build tries again (a timeout may not recur).
    with pytest.raises(RuntimeError, match="nvcc failed"):
        build_library(out_dir, ["90"], nvcc=nvcc, kernel_dir=kernels)  # lock was released
    assert log.read_text().count("build") == 2
    # A success clears the record.
    (tmp_path / "good").mkdir()
    good, _ = _fake_nvcc(tmp_path / "good")  # same version output: the same library name
    lib = build_library(out_dir, ["90"], nvcc=good, kernel_dir=kernels)
    assert lib.is_file() and not list(out_dir.glob("*.failed"))
