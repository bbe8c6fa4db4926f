"""No module-level mutable state in the serving path: state has one owner, an object
built for the process (the runtime, a store, the loaded kernels), never a module.

Checked from the source: no ``global`` statement, and no module-level name bound to a
mutable container (a list, dict or set display or comprehension, or a call making one).
Constant tables are read-only (tuples, frozensets, ``MappingProxyType``); ``__all__`` is
exempt. The one allowed ``global`` is the runtime's process-level reference: SGLang calls
the hooks registered at plugin load with its own arguments only, so they find the runtime
built later through it (``sgl_pic.binding.runtime``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import sgl_pic

PACKAGE = Path(sgl_pic.__file__).parent
# The packages a serving process runs.
SERVING = ("binding", "engine", "http", "store", "ops", "selection")
MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"})
ALLOWED_GLOBALS = frozenset({"binding/runtime.py: global _current"})
MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, MUTABLE_NODES):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def _findings(rel: str, source: str) -> list[str]:
    tree = ast.parse(source)
    out = [
        f"{rel}:{n.lineno}: global {', '.join(n.names)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Global)
        and f"{rel}: global {', '.join(n.names)}" not in ALLOWED_GLOBALS
    ]
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if names != ["__all__"] and _mutable(value):
            out.append(f"{rel}:{node.lineno}: module-level {', '.join(names)} is mutable")
    return out


def test_no_module_level_mutable_state_in_the_serving_path() -> None:
    found = [
        f
        for pkg in SERVING
        for path in sorted((PACKAGE / pkg).rglob("*.py"))
        for f in _findings(path.relative_to(PACKAGE).as_posix(), path.read_text())
    ]
    assert not found, found


def test_the_check_sees_what_it_forbids() -> None:
    src = "_cache = {}\n_seen: set[str] = set()\nX = (1, 2)\n\ndef f():\n    global _cache\n"
    assert [f.split(": ", 1)[1] for f in _findings("m.py", src)] == [
        "global _cache",
        "module-level _cache is mutable",
        "module-level _seen is mutable",
    ]
