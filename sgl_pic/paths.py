"""Where sgl_pic keeps files it derives (converted models, calibration results)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/sgl_pic``, else ``~/.cache/sgl_pic``: command-line defaults only;
    library functions take their directories explicitly."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sgl_pic"
