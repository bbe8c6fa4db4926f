"""The identity of the weights a server loads: a digest of the model's config files and
of every weight file's content, found where SGLang finds them.

``--model-path`` may be a local directory, a GGUF file or a hub id. SGLang never rewrites
a hub id to a local path; its loader reads the snapshot from the Hugging Face cache
(``--download-dir`` first, then the default cache). ModelScope ids reach the scheduler
already rewritten to a local directory (SGLang's ``handle_modelscope_paths``).

A weight file of a hub snapshot is a link to ``blobs/<sha256>``: the cache names an LFS
file by its SHA-256, so its digest is read from the name, not the bytes. Every other
weight file is hashed once per machine (``FileDigests``). Nothing here imports SGLang.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import NamedTuple

from sgl_pic.file_digests import FileDigests

WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})
# SGLang load formats whose weights are not the files at --model-path: random weights,
# weights streamed from another server or process, or a loader we cannot read.
UNFINGERPRINTED_FORMATS = frozenset(
    {"dummy", "remote", "remote_instance", "rdma", "ipc_cache", "private"}
)
_LFS_BLOB = re.compile(r"[0-9a-f]{64}")
_IDENTITY_TAG = b"sgl_pic.model.v2\0"


class ModelIdentityError(Exception):
    """The weights' identity cannot be taken; the message says why, for the self-check
    line (reuse is then off, and the server serves as plain SGLang)."""


class ModelFiles(NamedTuple):
    """The files that determine a model's KV bytes: its configs (read in full, small)
    and its weight files, each sorted by name."""

    root: Path
    configs: tuple[Path, ...]
    weights: tuple[Path, ...]


def resolve_model_files(
    model_path: str, revision: str | None = None, download_dir: str | None = None
) -> ModelFiles:
    """The files SGLang loads for ``model_path``: a directory's, a GGUF file itself, or a
    hub id's snapshot in the HF cache (never downloaded here). Raises
    ``ModelIdentityError`` when there is nothing to fingerprint."""
    path = Path(model_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelIdentityError(f"{model_path} is a file, and not a GGUF file")
        return ModelFiles(path.parent, (), (path,))
    root = path if path.is_dir() else _hub_snapshot(model_path, revision, download_dir)
    files = sorted(p for p in root.iterdir() if p.is_file())
    weights = tuple(p for p in files if p.suffix in WEIGHT_SUFFIXES)
    if not weights:
        raise ModelIdentityError(f"{root} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return ModelFiles(root, tuple(p for p in files if p.suffix == ".json"), weights)


def model_identity(
    model_path: str,
    digests: FileDigests,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> str:
    """Hex SHA-256 naming the weights SGLang loads for these arguments: every config's
    bytes and every weight file's content digest, by name. Two checkpoints share it only
    when those are equal, wherever they lie. Raises ``ModelIdentityError``."""
    if str(load_format).lower() in UNFINGERPRINTED_FORMATS:
        raise ModelIdentityError(
            f"--load-format {load_format} does not load the weights from the files at "
            "--model-path, so they have no identity to key chunks by"
        )
    files = resolve_model_files(model_path, revision, download_dir)
    h = hashlib.sha256(_IDENTITY_TAG)
    try:
        for p in files.configs:
            data = p.read_bytes()
            h.update(_named(p.name) + len(data).to_bytes(8, "little") + data)
        for p in files.weights:
            h.update(_named(p.name) + weight_digest(p, digests).encode())
    except OSError as e:
        raise ModelIdentityError(f"cannot read {e.filename}: {e.strerror}") from e
    return h.hexdigest()


def weight_digest(path: Path, digests: FileDigests) -> str:
    """A weight file's SHA-256: the name of the HF-cache blob it links to when that name
    is one (an LFS object's name is its SHA-256), else its bytes' (cached)."""
    if path.is_symlink():
        target = path.resolve()
        if target.parent.name == "blobs" and _LFS_BLOB.fullmatch(target.name):
            return target.name
    return digests.digest(path)


def _named(name: str) -> bytes:
    encoded = name.encode()
    return len(encoded).to_bytes(8, "little") + encoded


def _hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    """The cached snapshot of a hub id, where SGLang's loader looks: ``download_dir``
    first, then the default cache. Offline: a snapshot not cached is an error here."""
    from huggingface_hub import snapshot_download

    errors = []
    for cache_dir in dict.fromkeys((download_dir, None)):
        try:
            found = snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True
            )
        except Exception as e:  # the hub client's errors differ by version and cause
            errors.append(f"{type(e).__name__}: {e}")
            continue
        return Path(str(found))
    raise ModelIdentityError(
        f"{repo_id} is not a directory, a GGUF file or a snapshot in the Hugging Face "
        f"cache ({'; '.join(errors)})"
    )
