"""Loading a bench script by its path, as the tests of ``bench/`` do (bench is no package:
its scripts import each other by bare name and put ``bench/`` on ``sys.path`` themselves)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    """``bench/<name>.py``, executed as module ``bench_<name>`` and registered in
    ``sys.modules`` under that name (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
