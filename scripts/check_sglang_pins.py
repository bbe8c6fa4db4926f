"""Asks pip's resolver whether sgl-pic installs beside SGLang without moving its pins.

Runs ``pip install --dry-run --ignore-installed --report`` of this package (from a copy of
the tree, so nothing is written into the checkout) together with ``sglang==VERSION``, as
into a fresh environment, and compares every exact ``==`` pin of SGLang that applies here
with the version pip chose. Installs nothing; constraints.txt (the CPU install's own pins)
is not used. pip reads each wheel's metadata; where the index serves no separate metadata
file (PEP 658) it downloads the whole wheel (about 1.7 GB of CUDA wheels beside SGLang
0.5.23, more if torch is not on a local index; pip's cache keeps them for a rerun).

    python scripts/check_sglang_pins.py [--sglang VERSION]   # default: constraints.txt's

Exits 0 when every pin is kept, 1 when one moved or pip found no resolution (its conflict
is printed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def moved_pins(requires_dist: list[str], chosen: dict[str, str], env: dict[str, str]) -> list[str]:
    """Each exact pin in ``requires_dist`` (extras aside, markers evaluated in ``env``) that
    ``chosen`` (canonical name -> version) does not hold, as "pin -> chosen version"."""
    moved = []
    for req in map(Requirement, requires_dist):
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        for spec in req.specifier:
            if spec.operator != "==" or spec.version.endswith(".*"):
                continue
            got = chosen.get(canonicalize_name(req.name))
            if got is None or not spec.contains(got, prereleases=True):
                moved.append(f"{req.name}=={spec.version} -> {got or 'not installed'}")
    return moved


def constrained(name: str) -> str:
    """constraints.txt's exact version of ``name``."""
    for line in (REPO / "constraints.txt").read_text().splitlines():
        req = line.split("#")[0].strip()
        if req and canonicalize_name(Requirement(req).name) == canonicalize_name(name):
            return str(next(iter(Requirement(req).specifier)).version)
    raise SystemExit(f"constraints.txt pins no {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sglang", default=constrained("sglang"), help="SGLang's version (constraints.txt's)"
    )
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglang-pins-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, src / name)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        for name in ("sgl_pic", "kernels"):
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--report",
            str(report),
            str(src),
            f"sglang=={args.sglang}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=1800)
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            # pip's account of the conflict, without its progress and index warnings
            at = proc.stdout.find("The conflict is caused by:")
            cause = proc.stdout[at:].split("\n\n")[0] if at >= 0 else ""
            errors = [x for x in proc.stderr.splitlines() if not x.startswith("WARNING: ")]
            print(cause, *errors, sep="\n", file=sys.stderr)
            print(f"pip found no resolution beside sglang=={args.sglang} ({elapsed:.0f} s)")
            return 1
        data = json.loads(report.read_text())
    installs = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in data["install"]}
    chosen = {name: meta["version"] for name, meta in installs.items()}
    sglang = installs["sglang"]
    moved = moved_pins(sglang.get("requires_dist", []), chosen, data["environment"])
    for line in moved:
        print(f"moved: {line}")
    pins = ("torch", "transformers", "tokenizers")
    kept = ", ".join(f"{n} {chosen.get(n)}" for n in pins)
    print(
        f"sglang {sglang['version']} beside sgl-pic {chosen.get('sgl-pic')}: "
        f"{len(moved)} pin(s) moved; {kept} ({elapsed:.0f} s)"
    )
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
