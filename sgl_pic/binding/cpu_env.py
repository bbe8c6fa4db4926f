"""Preparing a process (and the processes SGLang spawns from it) to serve on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

STUBS_DIR = Path(__file__).resolve().parent / "cpu_stubs"

# SGLang flags that make it serve on the CPU; each is added only if the user gave none.
CPU_DEFAULTS: tuple[tuple[str, str | None], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--sampling-backend", "pytorch"),
    ("--disable-cuda-graph", None),
    ("--dtype", "float32"),
    # SGLang sizes the KV pool to fill memory (about 14 GB and a minute of allocation for
    # the embedded model); 32k tokens is plenty for tests and the benchmark.
    ("--max-total-tokens", "32768"),
)


def activate_cpu_stubs() -> None:
    """Makes the CPU stand-ins for sgl_kernel and torchvision importable here and in every
    child process (SGLang spawns its scheduler; PYTHONPATH is what a spawned child reads)."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    stubs = str(STUBS_DIR)
    if stubs not in sys.path:
        sys.path.insert(0, stubs)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if stubs not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([stubs, *parts])


def with_cpu_defaults(argv: list[str]) -> list[str]:
    """argv plus the CPU flags it does not already set."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in CPU_DEFAULTS:
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out
