"""Every script under bench/ answers ``--help``: exit status 0 and a usage line naming it.

A script is a ``bench/*.py`` file with an ``if __name__ == "__main__":`` block (the others
are modules the scripts share). Each runs as a user runs it, ``python bench/x.py --help``
from the repository root with the checkout on PYTHONPATH, in its own process; the scripts
run side by side, since those that import torch before parsing take a second or two each.
Help text goes through argparse's %-formatting, so a bare ``%`` in a help string fails here
rather than in front of a user.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _is_main_guard(node: ast.stmt) -> bool:
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
        return False
    test = node.test
    return (
        isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def scripts() -> list[Path]:
    """The bench/*.py files with a ``__main__`` block."""
    return [
        path
        for path in sorted((ROOT / "bench").glob("*.py"))
        if any(_is_main_guard(node) for node in ast.parse(path.read_text()).body)
    ]


def _help(path: Path) -> subprocess.CompletedProcess[str]:
    path_entries = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path_entries))}
    try:
        return subprocess.run(
            [sys.executable, str(path.relative_to(ROOT)), "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -1, str(e.stdout or ""), f"timed out: {e}")


@pytest.fixture(scope="module")
def answers() -> dict[str, subprocess.CompletedProcess[str]]:
    paths = scripts()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip((p.name for p in paths), pool.map(_help, paths), strict=True))


def test_scripts_are_found() -> None:
    """The scan finds the scripts (and not the shared modules), else the test below would
    pass by checking nothing."""
    names = {p.name for p in scripts()}
    assert {"fidelity.py", "serve.py", "soak.py", "workloads.py"} <= names
    assert not names & {"_common.py", "_server.py", "soak_tenants.py", "workload_streams.py"}


def test_every_script_answers_help(answers: dict[str, subprocess.CompletedProcess[str]]) -> None:
    failed = {
        name: f"rc {out.returncode}: {out.stderr.strip()[-600:]}"
        for name, out in answers.items()
        if out.returncode != 0 or not out.stdout.startswith(f"usage: {name}")
    }
    assert not failed, "\n".join(f"bench/{n}: {why}" for n, why in failed.items())
