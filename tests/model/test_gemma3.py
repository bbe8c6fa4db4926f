"""Gemma 3 270M, the second real model: installed on demand (``scripts/install_gemma3.sh``).
Tests that need its weights skip, naming the install command, where it has not run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sgl_pic.model import gemma3


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemma3, "PACKAGE", "no_such_package_sgl_pic")
    with pytest.raises(FileNotFoundError, match="scripts/install_gemma3.sh"):
        gemma3.ensure_gemma3()
    assert gemma3.installed_path() is None


def test_a_directory_not_converted_from_the_package_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = SimpleNamespace(EXPECTED_SHA256="0" * 64)
    monkeypatch.setitem(sys.modules, "fake_gemma_pkg", fake)
    monkeypatch.setattr(gemma3, "PACKAGE", "fake_gemma_pkg")
    (tmp_path / "config.json").write_text("{}")
    assert gemma3.installed_path(tmp_path) is None


def test_installed_model_is_gemma3_with_sliding_and_global_layers() -> None:
    path = gemma3.installed_path()
    if path is None:
        pytest.skip(f"Gemma 3 270M is not installed: run `{gemma3.INSTALL}`")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [gemma3.ARCHITECTURE]
    assert "quantization_config" not in config
    kinds = set(config["layer_types"])
    assert kinds == {"sliding_attention", "full_attention"} and config["sliding_window"] > 0
    rope = config["rope_parameters"]
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    again = gemma3.ensure_gemma3()
    assert again.converted is False and again.path == path
