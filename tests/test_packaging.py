"""The wheel ships the CUDA sources, and an installed sgl_pic finds them; our dependencies
admit SGLang's exact pins.

The sources live in top-level ``kernels/``; pyproject.toml maps that directory into the
package as ``sgl_pic/kernels``. The wheel is built from a copy of the tree, so the build
writes nothing into the checkout other people work in.

pyproject.toml's dependencies must hold every exact pin of the installed SGLang, so that
``pip install sgl-pic`` beside it keeps SGLang's versions; constraints.txt holds the CPU
install's exact versions, SGLang's own except torch (the CPU wheel).
scripts/check_sglang_pins.py asks pip's resolver the same question.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
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


def _applies(req: Requirement) -> bool:
    """Whether ``req`` applies here without extras (its markers, for this platform)."""
    return req.marker is None or req.marker.evaluate({"extra": ""})


def _pins_outside(pinned: list[str], ours: list[str]) -> list[str]:
    """Each exact ``==`` pin in ``pinned`` that our requirement of the same name rejects,
    as "pin (ours: spec)". Requirements that do not apply here (extras, other platforms)
    are left out on both sides."""
    specs = {canonicalize_name(r.name): r.specifier for r in map(Requirement, ours) if _applies(r)}
    outside = []
    for req in map(Requirement, pinned):
        spec = specs.get(canonicalize_name(req.name))
        if spec is None or not _applies(req):
            continue
        for pin in req.specifier:
            exact = pin.operator == "==" and not pin.version.endswith(".*")
            if exact and not spec.contains(pin.version, prereleases=True):
                outside.append(f"{req.name}=={pin.version} (ours: {req.name}{spec})")
    return outside


def _dependencies() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def _constraints() -> list[str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


@pytest.fixture(scope="module")
def sglang_requires() -> list[str]:
    try:
        requires = importlib.metadata.requires("sglang")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("SGL_PIC_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip("sglang not installed (scripts/install_sglang_cpu.sh)")
    assert requires, "sglang's metadata lists no requirements"
    return requires


def test_pins_outside_catches_a_conflicting_specifier() -> None:
    sglang = [
        "torch==2.14.1",
        "tokenizers==0.23.2",
        "numpy",
        "gguf>=0.10",
        "av==16.1.0; python_version < '3'",  # not this platform
        "accelerate==1.0.0; extra == 'test'",  # an extra
    ]
    ours = ["torch==2.13.0", "tokenizers>=0.23.2,<0.24", "numpy<2.4", "av==1", "accelerate==2"]
    assert _pins_outside(sglang, ours) == ["torch==2.14.1 (ours: torch==2.13.0)"]
    assert _pins_outside(sglang, ["Tokenizers>0.23.2"]) == [
        "tokenizers==0.23.2 (ours: tokenizers>0.23.2)"
    ]
    assert _pins_outside(sglang, ["torch>=2.13.0,<2.15", "tokenizers>=0.23.2"]) == []


def test_dependencies_admit_every_sglang_pin(sglang_requires: list[str]) -> None:
    ours = _dependencies()
    assert _pins_outside(sglang_requires, ours) == [], "pyproject.toml would move SGLang's pins"
    # Not vacuous: SGLang pins these three exactly and we require each of them.
    pinned = {
        canonicalize_name(r.name)
        for r in map(Requirement, sglang_requires)
        if _applies(r) and any(s.operator == "==" for s in r.specifier)
    }
    assert {"torch", "transformers", "tokenizers"} <= pinned & {
        canonicalize_name(Requirement(d).name) for d in ours
    }


def test_constraints_are_sglangs_pins_but_torch(sglang_requires: list[str]) -> None:
    """constraints.txt installs SGLang's own versions, so the tests run on them; torch alone
    is the CPU wheel's."""
    outside = _pins_outside(sglang_requires, _constraints())
    assert [o for o in outside if not o.startswith("torch==")] == []
    assert "torch==2.13.0" in _constraints()
    assert f"sglang=={importlib.metadata.version('sglang')}" in _constraints()


def test_constraints_satisfy_the_dependencies() -> None:
    assert _pins_outside(_constraints(), _dependencies()) == []
