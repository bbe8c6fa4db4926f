"""The packages of ``sgl_pic`` stand in layers: each imports only the layers below it.

    core      the shared domain (marks, tenants, runs, admitted requests, metric records)
    engine    the chunk path, driving SGLang only through ``engine.phase_port`` and the
              duck-typed pool ``engine.kv_access`` reads
    http      the HTTP edge: requests in, marks signed (core, not the engine)
    binding   what touches SGLang: hooks, phase batches, the radix cache, the composition
    cli       entry points over all of them

``store``, ``selection``, ``ops``, ``oracle`` and ``model`` are libraries under them, and
the top-level modules named in ``BASE`` are plain helpers anyone may import. SGLang is
imported only by ``binding``, ``http`` and ``cli``. The graph is read from the source
(``ast``), every import wherever it stands (module level, ``TYPE_CHECKING``, inside a
function), as ``tests/test_import_graph.py`` reads it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sgl_pic"

# Top-level modules that import no package of sgl_pic but each other: helpers for all.
BASE = frozenset(
    {
        "config",
        "declare",
        "file_digests",
        "frontend",
        "keys",
        "layout",
        "model_identity",
        "paths",
        "prompts",
        "registry",
        "rope",
        "worker_threads",
    }
)
# Which layers each layer may import (BASE always).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset({"store"}),
    "store": frozenset(),
    "selection": frozenset(),
    "ops": frozenset(),
    "model": frozenset(),
    "oracle": frozenset({"selection"}),
    "engine": frozenset({"core", "store", "selection", "ops"}),
    "http": frozenset({"core"}),
    "binding": frozenset({"core", "engine", "http", "store", "selection", "ops"}),
    "cli": frozenset(
        {"binding", "core", "engine", "fidelity", "http", "model", "oracle", "ops", "selection"}
        | {"store"}
    ),
    # Entry points and tools at the top level.
    "check": frozenset({"cli"}),
    "launch_server": frozenset({"cli"}),
    "fidelity": frozenset({"oracle"}),
}
# Single module edges across the layers, each with the change that removes it; the test
# fails when one is gone, so that its entry goes with it.
EXCEPTIONS: dict[tuple[str, str], str] = {
    (
        "sgl_pic.binding.calibration",
        "sgl_pic.cli.calibrate",
    ): "the calibration search moves out of cli (to store.cost_model's side), cli keeps "
    "the command",
}
SGLANG_LAYERS = frozenset({"binding", "http", "cli"})


def layer_of(module: str) -> str:
    """``sgl_pic.engine.executor`` -> ``engine``; ``sgl_pic.config`` -> ``config``."""
    return module.split(".")[1]


def imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module or package, "path:line") for every import."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        source = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            out += [(source, n, where) for n in names]
    return out


def crossings() -> dict[tuple[str, str], str]:
    """Every import of one layer by another it may not import, by module edge."""
    bad: dict[tuple[str, str], str] = {}
    for source, target, where in imports():
        if not target.startswith("sgl_pic.") or source == "sgl_pic":
            continue
        src, dst = layer_of(source), layer_of(target)
        if src == dst or dst in BASE:
            continue
        if src in BASE or dst not in ALLOWED.get(src, frozenset()):
            bad[(source, target)] = where
    return bad


def test_every_module_is_in_a_layer() -> None:
    layers = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    layers -= {"__init__", "__pycache__"}
    assert layers == BASE | set(ALLOWED)


def test_the_layers_import_only_downwards() -> None:
    bad = crossings()
    unexpected = {edge: where for edge, where in bad.items() if edge not in EXCEPTIONS}
    assert not unexpected, unexpected
    gone = [edge for edge in EXCEPTIONS if edge not in bad]
    assert not gone, f"remove from EXCEPTIONS, no longer imported: {gone}"


def test_the_layers_form_no_loop() -> None:
    # A loop in ALLOWED would let a request's path return to a layer it left.
    seen: dict[str, int] = {}

    def visit(layer: str) -> None:
        assert seen.get(layer) != 1, f"layers loop through {layer}"
        if seen.get(layer) == 2:
            return
        seen[layer] = 1
        for below in ALLOWED.get(layer, frozenset()):
            visit(below)
        seen[layer] = 2

    for layer in ALLOWED:
        visit(layer)


def test_only_the_sglang_layers_import_sglang() -> None:
    outside = [
        (source, where)
        for source, target, where in imports()
        if target.split(".")[0] == "sglang" and layer_of(source) not in SGLANG_LAYERS
    ]
    assert not outside, outside


def test_the_core_and_the_engine_stand_apart_from_binding_and_http() -> None:
    # The rule, spelled out: nothing below binding reaches it or the HTTP edge.
    for layer in ("core", "engine"):
        assert not ALLOWED[layer] & {"binding", "http", "cli"}, layer
    assert not ALLOWED["http"] & {"engine", "binding"}
