import pytest
import torch

from sgl_pic.store import base
from sgl_pic.store.base import ChunkKV, check_key, make_store, normalize_indices, store_names
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.errors import RecordShapeError, StoreError
from sgl_pic.store.host import HostStore, HostStoreConfig
from tests.store.helpers import MODEL, make_record


def test_registry_names_and_factory(tmp_path):
    assert set(store_names()) >= {"host", "disk", "tiered"}
    host = make_store("host", HostStoreConfig(capacity_bytes=1 << 20), MODEL)
    assert isinstance(host, HostStore)
    disk = make_store("disk", DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 20), MODEL)
    assert disk.name == "disk"
    with pytest.raises(ValueError, match="valid stores"):
        make_store("redis", None, MODEL)


@pytest.mark.parametrize("key", ["../etc/passwd", "ab" * 31, "A" * 64, "x" * 64, ""])
def test_keys_must_be_hex_digests(key):
    with pytest.raises(ValueError):
        check_key(key)


def test_record_validation():
    rec = make_record()
    with pytest.raises(RecordShapeError):
        ChunkKV(rec.key, MODEL, rec.token_ids[:-1], rec.k, rec.v)
    with pytest.raises(RecordShapeError):
        ChunkKV(rec.key, MODEL, rec.token_ids, rec.k, rec.v[:, :-1])
    with pytest.raises(RecordShapeError):
        ChunkKV(rec.key, MODEL, rec.token_ids, rec.k, rec.v, ranking=torch.zeros(3))
    with pytest.raises(RecordShapeError):
        ChunkKV(rec.key, MODEL, rec.token_ids, rec.k.double(), rec.v.double())
    assert issubclass(RecordShapeError, StoreError)
    assert rec.nbytes == 2 * rec.k.numel() * 4


def test_normalize_indices():
    assert normalize_indices([5, 1, 5, 0], 6).tolist() == [0, 1, 5]
    assert normalize_indices(None, 3).tolist() == [0, 1, 2]
    with pytest.raises(RecordShapeError):
        normalize_indices([6], 6)
    with pytest.raises(RecordShapeError):
        normalize_indices([-1], 6)


def test_no_pickle_in_store_sources():
    import pathlib

    # Every module of the package: records and calibration files are read in several.
    package = pathlib.Path(base.__file__).parents[1]
    sources = sorted(package.rglob("*.py"))
    assert package / "store" / "record" / "read.py" in sources
    assert package / "cli" / "calibrate.py" in sources
    for path in sources:
        text = path.read_text()
        for banned in ("import pickle", "torch.load(", "torch.save(", "allow_pickle=True"):
            assert banned not in text, f"{banned} in {path.name}"
