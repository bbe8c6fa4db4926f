"""A GGUF file dequantized once into a float32 Hugging Face directory.

transformers and SGLang load such a directory (config, tokenizer, safetensors) in seconds,
where SGLang's CPU path serves no GGUF quantization. The conversion is idempotent: a
manifest records the SHA-256 of the source GGUF and of every written file, and is
re-verified on each call; a directory that fails it is rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

MANIFEST = "sgl_pic_manifest.json"


class ConvertedModel(NamedTuple):
    path: Path
    converted: bool  # False when a verified directory already existed


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def ensure_converted(
    gguf: Path, target: Path, architecture: str, conversion_version: int
) -> ConvertedModel:
    """A verified float32 directory of ``gguf`` at ``target``, converting it once. The
    config names ``architecture`` (the SGLang model class that serves it)."""
    gguf_sha = sha256_file(gguf)
    if verify(target, gguf_sha, conversion_version):
        return ConvertedModel(target, converted=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp dir and rename: a crash never leaves a half directory
    # that a later call would trust.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, tmp, architecture)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        manifest = {
            "conversion_version": conversion_version,
            "source": gguf.name,
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
    if not verify(target, gguf_sha, conversion_version):
        raise RuntimeError(f"converted model at {target} failed its checksum verification")
    return ConvertedModel(target, converted=True)


def verify(target: Path, gguf_sha: str, conversion_version: int) -> bool:
    """Whether ``target`` is this conversion of the GGUF whose SHA-256 is ``gguf_sha``,
    every file as written."""
    manifest_path = target / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if (
        manifest.get("conversion_version") != conversion_version
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


def _convert(gguf: Path, out: Path, architecture: str) -> None:
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
    config["architectures"] = [architecture]
    rope = config.get("rope_parameters") or {}
    # Older readers (SGLang's, transformers 4.x) look for the flat key; a table per layer
    # type (Gemma 3) is read as it is.
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tok.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def main_for(
    ensure: Callable[[Path | None], ConvertedModel], description: str, argv: list[str] | None
) -> int:
    """The command line of a converted model: ``--cache-dir``, converts if needed, prints
    the directory."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cache-dir", type=Path, default=None, help="output directory")
    model = ensure(parser.parse_args(argv).cache_dir)
    verb = "converted" if model.converted else "verified"
    print(f"{verb}: {model.path}", file=sys.stderr)
    print(model.path)
    return 0
