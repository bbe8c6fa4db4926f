"""Device hygiene: tensors made on the serving path say which device they go to.

A torch factory call without ``device=`` makes a CPU tensor. On a GPU server that is a
silent host round trip (or a device mismatch) on every request, which no CPU test shows.
So every factory call under ``SCANNED_PATHS`` names its device, or carries an opt-out
comment ``# host: <why>`` on one of its lines for tensors that are meant to be on the CPU
(host-tier buffers, index lists SGLang itself keeps on the CPU). ``*_like`` factories
inherit their input's device and are not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
# The packages whose tensors live next to SGLang's pool (paths relative to the repo root).
SCANNED_PATHS: tuple[str, ...] = (
    "sgl_pic/binding",
    "sgl_pic/engine",
    "sgl_pic/http",
    "sgl_pic/store",
)
FACTORIES: frozenset[str] = frozenset(
    {
        "arange",
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor",
        "randn",
        "rand",
        "randint",
        "randperm",
        "linspace",
        "eye",
    }
)
# The reason is required: a bare "# host:" says nothing to the next reader.
OPT_OUT = re.compile(r"#\s*host:\s*\S")


class Finding(NamedTuple):
    path: str
    line: int
    call: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: torch.{self.call}(...) without device="


def _is_torch_factory(node: ast.Call) -> str | None:
    func = node.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
        and func.attr in FACTORIES
    ):
        return func.attr
    return None


def scan_source(source: str, path: str) -> list[Finding]:
    """Factory calls in ``source`` with no ``device=`` and no ``# host: <why>`` on any of
    the call's lines."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, ast.Call):
            continue
        name = _is_torch_factory(node)
        if name is None or any(kw.arg == "device" for kw in node.keywords):
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if any(OPT_OUT.search(line) for line in span):
            continue
        found.append(Finding(path, node.lineno, name))
    return sorted(found)


def scan_paths(roots: tuple[str, ...] = SCANNED_PATHS) -> list[Finding]:
    found = []
    for root in roots:
        for file in sorted((REPO / root).rglob("*.py")):
            rel = file.relative_to(REPO).as_posix()
            found += scan_source(file.read_text(), rel)
    return found


def test_every_factory_call_names_its_device() -> None:
    found = scan_paths()
    assert not found, "tensors created without device= (add it, or '# host: <why>'):\n" + (
        "\n".join(map(str, found))
    )


def test_scanned_paths_exist_and_hold_factory_calls() -> None:
    # A renamed package would make the scan pass vacuously.
    for root in SCANNED_PATHS:
        assert (REPO / root).is_dir(), root
    calls = 0
    for root in SCANNED_PATHS:
        for file in (REPO / root).rglob("*.py"):
            tree = ast.parse(file.read_text())
            calls += sum(
                isinstance(n, ast.Call) and _is_torch_factory(n) is not None for n in ast.walk(tree)
            )
    assert calls > 0


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("torch.zeros(3)", [1]),
        ("torch.zeros(3, device=x.device)", []),
        ("torch.zeros_like(x)", []),
        ("torch.tensor([1, 2], dtype=torch.int64)", [1]),
        ("torch.arange(4)  # host: SGLang keeps req_to_token indices on the CPU", []),
        ("torch.arange(4)  # host:", [1]),
        ("torch.arange(4)  # host:   ", [1]),
        ("torch.empty(\n    0,\n    dtype=torch.int64,  # host: staging list\n)", []),
        ("torch.empty(\n    0,\n    dtype=torch.int64,\n)", [1]),
        ("x = 1\ny = torch.randperm(5, generator=g)", [2]),
        ("torch.cat([a, b])", []),
        ("np.zeros(3)", []),
    ],
)
def test_scanner(source: str, flagged: list[int]) -> None:
    assert [f.line for f in scan_source(source, "x.py")] == flagged
