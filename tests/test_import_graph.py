"""No import cycles in ``sgl_pic/`` or ``bench/``.

The graph is read from the source (``ast``), never by importing anything, so it covers the
GPU-only and SGLang-only modules as well. A node is a module file: ``sgl_pic/a/b.py`` is
``sgl_pic.a.b``, a package's ``__init__.py`` is the package, and ``bench/x.py`` is
``bench.x`` (bench scripts import each other by bare name, ``from _server import ...``,
with ``bench/`` on ``sys.path``; a bare name that is a file in ``bench/`` resolves to it).

What counts as an edge ``A -> B``: every ``import B`` / ``from B import n`` in A, wherever it
stands:
- at module level: the import runs when A is imported, the plain case of a loop;
- under ``if TYPE_CHECKING:``: it runs only for the type checker, yet A's interface is
  written in B's types, so the two modules can only be understood, changed and moved
  together: a loop in the design even where it is none at runtime (the known
  ``config -> registry -> selection.base -> config`` loop was of this kind);
- inside a function: such an import is usually how a loop was hidden from the
  interpreter, not removed; A still depends on B to do its work. It counts too.
``from P import n`` is an edge to ``P.n`` when that is a module (a submodule import), else
to ``P``. Importing ``a.b.c`` also runs the packages ``a`` and ``a.b`` first; those implicit
edges are not counted: a package whose ``__init__`` re-exports its modules would otherwise
form a loop with every module of it that imports a sibling by its full name, which is how
packages are meant to be built. Imports of anything outside the two trees are dropped.

A cycle that can only be broken in a file this test does not own may be listed in
``ALLOWED`` with the exact change that removes it; the test fails when a listed cycle is
gone (so that the entry is removed with it), and on every cycle not listed.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TREES = ("sgl_pic", "bench")

# Strongly connected components allowed for now, as sets of module names, each with the
# change that removes it (in files the change that introduced this test could not edit).
ALLOWED: dict[frozenset[str], str] = {}


class Edge(NamedTuple):
    source: str  # importing module
    target: str  # imported module
    where: str  # "path:line"
    kind: str  # "module", "type-checking" or "function"


def module_names() -> dict[str, Path]:
    """Every module of the two trees, by dotted name."""
    names: dict[str, Path] = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement of a module with where it stands (module, type-checking or
    function), wherever it is nested."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    # A statement at the top of the (wrapped) body is itself an import.
    for stmt in tree.body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            yield stmt, "module"
        else:
            yield from walk(ast.Module(body=[stmt], type_ignores=[]), "module")


def _resolve(name: str, package: str, level: int) -> str:
    """The absolute name of ``from <level dots><name> import`` inside ``package``."""
    if level == 0:
        return name
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def import_edges() -> list[Edge]:
    names = module_names()
    bench_bare = {n.split(".", 1)[1]: n for n in names if n.startswith("bench.")}

    def known(name: str, in_bench: bool) -> str | None:
        if name in names:
            return name
        if in_bench and name.split(".")[0] in bench_bare:
            return bench_bare[name.split(".")[0]]
        return None

    edges: list[Edge] = []
    for module, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        package = module if is_package else module.rpartition(".")[0]
        in_bench = module.startswith("bench.")
        where_of = str(path.relative_to(ROOT))
        for node, kind in _imports(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name, in_bench) for alias in node.names]
            else:
                base = _resolve(node.module or "", package, node.level)
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.append(known(sub, in_bench) or known(base, in_bench))
            for target in targets:
                if target is not None and target != module:
                    edges.append(Edge(module, target, f"{where_of}:{node.lineno}", kind))
    return edges


def strongly_connected(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's components (iterative), only those with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(succ.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ.get(nxt, ()))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp: list[str] = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def shortest_cycle(start: str, members: set[str], succ: dict[str, list[str]]) -> list[str]:
    """The shortest loop from ``start`` back to it inside one component."""
    parent: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for nxt in succ.get(node, ()):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt in members and nxt not in seen:
                seen.add(nxt)
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in no loop")


def cycles() -> dict[frozenset[str], str]:
    """Each import cycle, as its component, with a description naming loops through all
    of its modules and the import statements that make each step."""
    edges = import_edges()
    succ: dict[str, list[str]] = {}
    by_pair: dict[tuple[str, str], list[Edge]] = {}
    for e in edges:
        if e.target not in succ.setdefault(e.source, []):
            succ[e.source].append(e.target)
        by_pair.setdefault((e.source, e.target), []).append(e)
    out: dict[frozenset[str], str] = {}
    for comp in strongly_connected(sorted(module_names()), succ):
        # Loops until every module of the component is on one, shortest first from each.
        covered: set[str] = set()
        loops: list[str] = []
        for start in comp:
            if start in covered:
                continue
            loop = shortest_cycle(start, set(comp), succ)
            covered.update(loop)
            loops.append(
                "\n".join(
                    f"  {a} -> {b}  ("
                    + ", ".join(sorted({f"{e.where} {e.kind}" for e in by_pair[(a, b)]}))
                    + ")"
                    for a, b in zip(loop, loop[1:], strict=False)
                )
            )
        out[frozenset(comp)] = f"cycle among {', '.join(comp)}:\n" + "\n  --\n".join(loops)
    return out


def test_the_graph_sees_every_kind_of_import() -> None:
    """The reader finds imports at module level, under TYPE_CHECKING, inside functions,
    relative ones and bench's bare names (else the cycle test could pass by blindness)."""
    by_source: dict[str, set[tuple[str, str]]] = {}
    for e in import_edges():
        by_source.setdefault(e.source, set()).add((e.target, e.kind))
    # Relative import at module level in a package __init__.
    assert ("sgl_pic.selection.base", "module") in by_source["sgl_pic.selection"]
    # A bench script's bare-name import of a bench module.
    assert ("bench._server", "module") in by_source["bench.serve"]
    # A function-local import.
    assert ("sgl_pic.cli.server_process", "function") in by_source["bench._server"]
    kinds = {kind for edges in by_source.values() for _, kind in edges}
    assert kinds == {"module", "type-checking", "function"}


def test_no_import_cycles() -> None:
    found = cycles()
    unexpected = [text for comp, text in found.items() if comp not in ALLOWED]
    gone = [sorted(comp) for comp in ALLOWED if comp not in found]
    assert not unexpected, "import cycles:\n" + "\n".join(unexpected)
    assert not gone, f"allowed cycles no longer exist, remove them from ALLOWED: {gone}"


def test_components_and_loops_of_a_small_graph() -> None:
    succ = {"a": ["b"], "b": ["a", "c"], "c": ["d"], "d": ["c", "e"], "e": []}
    assert strongly_connected(["a", "b", "c", "d", "e"], succ) == [["c", "d"], ["a", "b"]]
    assert shortest_cycle("b", {"a", "b"}, succ) == ["b", "a", "b"]
