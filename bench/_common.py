"""What the oracle benchmarks share (bench/fidelity.py, bench/diagnose.py and the studies
built on them): the default data, the embedded model, and the commit a run describes.
Neither benchmark imports the other for these, so each runs and imports on its own."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"


def embedded_path() -> Path:
    """The embedded model's directory (fetched into the cache on first use)."""
    from sgl_pic.model.embedded import ensure_embedded_model

    return ensure_embedded_model().path


def git_state() -> dict[str, Any]:
    """The commit the run describes and whether the tree had changes."""

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
