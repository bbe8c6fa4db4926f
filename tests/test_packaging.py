"""The wheel ships the CUDA sources, and an installed sgl_pic finds them.

The sources live in top-level ``kernels/``; pyproject.toml maps that directory into the
package as ``sgl_pic/kernels``. The wheel is built from a copy of the tree, so the build
writes nothing into the checkout other people work in.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
KERNEL_PATTERNS = ("*.cu", "*.cuh", "*.h", "nvcc.flags")


def _kernel_files() -> set[str]:
    return {p.name for pattern in KERNEL_PATTERNS for p in (REPO / "kernels").glob(pattern)}


def test_every_subpackage_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set(find_packages(where=str(REPO), include=["sgl_pic*"]))
    assert listed - {"sgl_pic.kernels"} == found, "update [tool.setuptools] packages"
    assert config["package-dir"] == {"sgl_pic.kernels": "kernels"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the directory it was installed into with --target)."""
    root = tmp_path_factory.mktemp("pkg")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("sgl_pic", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    dist = root / "dist"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", dist],
        check=True,
        cwd=root,
        timeout=300,
    )
    (wheel,) = dist.glob("sgl_pic-*.whl")
    target = root / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", target, wheel],
        check=True,
        cwd=root,
        timeout=300,
    )
    return wheel, target


def test_wheel_contains_the_kernel_sources(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {
        n.removeprefix("sgl_pic/kernels/") for n in names if n.startswith("sgl_pic/kernels/")
    }
    expected = _kernel_files()
    assert {"nvcc.flags", "sgl_pic_kernels.h", "common.cuh"} <= expected
    assert any(n.endswith(".cu") for n in expected)
    assert expected <= shipped
    for name in expected:
        data = zipfile.ZipFile(wheel).read(f"sgl_pic/kernels/{name}")
        assert data == (REPO / "kernels" / name).read_bytes(), name
    assert "sgl_pic/ops/cuda.py" in names


def test_installed_package_resolves_its_own_kernels(installed: tuple[Path, Path]) -> None:
    _, target = installed
    code = (
        "import pathlib, sgl_pic, sgl_pic.ops.cuda as c\n"
        "pkg = pathlib.Path(sgl_pic.__file__).resolve().parent\n"
        "print(pkg)\n"
        "assert c.KERNEL_DIR == pkg / 'kernels', (c.KERNEL_DIR, pkg)\n"
        "assert c.nvcc_flags(), 'no flags'\n"
        "print(sorted(p.name for p in c.KERNEL_DIR.glob('*.cu')))\n"
    )
    # Run outside the checkout with only the install dir in front, so the source tree's
    # kernels/ cannot be what is found.
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(target.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=target.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    pkg_line, cu_line = proc.stdout.splitlines()
    assert Path(pkg_line) == (target / "sgl_pic").resolve()
    assert cu_line == repr(sorted(p.name for p in (REPO / "kernels").glob("*.cu")))


def test_source_checkout_resolves_top_level_kernels() -> None:
    from sgl_pic.ops import cuda

    if (Path(cuda.__file__).resolve().parents[1] / "kernels").is_dir():
        pytest.skip("running from an installed package, not the checkout")
    assert cuda.KERNEL_DIR == REPO / "kernels"
