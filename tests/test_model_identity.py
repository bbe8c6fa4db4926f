"""``model_identity``: what a server's chunks are keyed by, found where SGLang finds the
weights (a directory, a GGUF file, a hub id in the HF cache), never hashing a file twice
on one machine."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sgl_pic.file_digests import FileDigests
from sgl_pic.model_identity import ModelIdentityError, model_identity, resolve_model_files

CONFIG = b'{"model_type": "llama", "hidden_size": 8}'
SHARDS = {
    "model-00001-of-00002.safetensors": b"\x01" * 4096,
    "model-00002-of-00002.safetensors": b"\x02" * 999,
}


def model_dir(root: Path, shards: dict[str, bytes] = SHARDS, config: bytes = CONFIG) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_bytes(config)
    (root / "tokenizer_config.json").write_bytes(b"{}")
    (root / "README.md").write_text("not part of the identity")
    for name, data in shards.items():
        (root / name).write_bytes(data)
    return root


def hub_cache(cache: Path, repo: str, src: Path, revision: str = "a" * 40) -> Path:
    """``src``'s files laid out as huggingface_hub caches them: weights link to
    ``blobs/<sha256>`` (LFS), small files to ``blobs/<git sha1>``."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / revision
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    for f in src.iterdir():
        data = f.read_bytes()
        lfs = f.suffix == ".safetensors"
        name = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(data).hexdigest()
        (blobs / name).write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / name)
    return snap


def test_identity_names_configs_and_weight_contents(tmp_path: Path) -> None:
    digests = FileDigests(tmp_path / "cache")
    a = model_identity(str(model_dir(tmp_path / "a")), digests)
    assert a == model_identity(str(model_dir(tmp_path / "copy")), digests)  # where is no part
    files = resolve_model_files(str(tmp_path / "a"))
    assert [p.name for p in files.weights] == sorted(SHARDS)
    assert [p.name for p in files.configs] == ["config.json", "tokenizer_config.json"]
    other_weights = {**SHARDS, "model-00002-of-00002.safetensors": b"\x03" * 999}
    assert model_identity(str(model_dir(tmp_path / "b", other_weights)), digests) != a
    other_config = model_dir(tmp_path / "c", config=CONFIG.replace(b"8", b"16"))
    assert model_identity(str(other_config), digests) != a
    renamed = {
        "weights.safetensors" if k.startswith("model-00002") else k: v for k, v in SHARDS.items()
    }
    assert model_identity(str(model_dir(tmp_path / "d", renamed)), digests) != a


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(tmp_path: Path) -> None:
    """Offline: the snapshot SGLang's loader would read. The LFS blobs' names are their
    SHA-256, so the identity equals that of a plain copy, with no weight byte read."""
    src = model_dir(tmp_path / "src")
    cache = tmp_path / "hf"
    snap = hub_cache(cache, "org/tiny", src)
    digests = FileDigests(tmp_path / "digests")
    ident = model_identity("org/tiny", digests, download_dir=str(cache))
    assert digests.hashed == 0
    assert ident == model_identity(str(snap), FileDigests(None))
    assert ident == model_identity(str(src), FileDigests(None))
    assert model_identity("org/tiny", digests, revision="a" * 40, download_dir=str(cache)) == ident
    with pytest.raises(ModelIdentityError, match="org/absent is not a directory"):
        model_identity("org/absent", digests, download_dir=str(cache))
    with pytest.raises(ModelIdentityError, match="org/tiny"):
        model_identity("org/tiny", digests, revision="b" * 40, download_dir=str(cache))


def test_a_gguf_file_is_its_own_identity(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 100)
    digests = FileDigests(None)
    ident = model_identity(str(f), digests)
    f2 = tmp_path / "n.gguf"
    f2.write_bytes(b"GGUF" + b"\x01" * 100)
    assert model_identity(str(f2), digests) != ident
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelIdentityError, match="not a GGUF file"):
        model_identity(str(tmp_path / "notes.txt"), digests)


def test_what_has_no_identity_is_refused_with_why(tmp_path: Path) -> None:
    digests = FileDigests(None)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes(CONFIG)
    with pytest.raises(ModelIdentityError, match="no weight files"):
        model_identity(str(config_only), digests)
    full = model_dir(tmp_path / "m")
    for fmt in ("dummy", "remote", "remote_instance"):
        with pytest.raises(ModelIdentityError, match=f"--load-format {fmt}"):
            model_identity(str(full), digests, load_format=fmt)
