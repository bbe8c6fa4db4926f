import errno
import os
import struct
import threading

import pytest
import torch

from sgl_pic.store.errors import (
    BadMagicError,
    CorruptRecordError,
    ForeignModelError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from sgl_pic.store.format import (
    ALIGN,
    FORMAT_VERSION,
    MAGIC,
    TMP_PREFIX,
    RecordFile,
    WriteCancelled,
    read_header,
    read_record,
    tmp_name,
    tmp_owner,
    write_record,
)
from tests.store.helpers import MODEL, OTHER_MODEL, make_record, same_record


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ranking", [True, False])
def test_round_trip_bit_exact(tmp_path, dtype, ranking):
    rec = make_record(dtype=dtype, ranking=ranking, layer_start=4)
    path = tmp_path / "r.sglkv"
    size = write_record(path, rec)
    assert path.stat().st_size == size
    back = read_record(path, MODEL, rec.key, rec.token_ids)
    assert same_record(rec, back)


def test_layout_prefix_alignment_and_size(tmp_path, record):
    path = tmp_path / "r.sglkv"
    write_record(path, record)
    raw = path.read_bytes()
    magic, version, header_len, _ = struct.unpack("<8sII32s", raw[:48])
    assert (magic, version) == (MAGIC, FORMAT_VERSION)
    h = read_header(path)
    assert h.data_offset % ALIGN == 0 and h.data_offset >= 48 + header_len
    assert len(raw) == h.data_offset + record.nbytes
    # Layer 1's K starts exactly where the layout says, as raw float32 rows.
    off = h.data_offset + 2 * h.layer_bytes
    k1 = torch.frombuffer(bytearray(raw[off : off + h.layer_bytes]), dtype=torch.float32)
    assert torch.equal(k1.view(record.k[1].shape), record.k[1])


def test_sparse_read_returns_exact_rows(tmp_path):
    rec = make_record(num_layers=4, num_tokens=100, layer_start=2)
    path = tmp_path / "r.sglkv"
    write_record(path, rec, block_tokens=16)
    with RecordFile(path, MODEL) as f:
        idx, k, v = f.read_layers(range(3, 5), [99, 3, 3, 40])
    assert idx.tolist() == [3, 40, 99]
    assert torch.equal(k, rec.k[1:3, [3, 40, 99]])
    assert torch.equal(v, rec.v[1:3, [3, 40, 99]])


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_layer_is_detected_and_other_layers_still_read(tmp_path):
    rec = make_record(num_layers=3, num_tokens=64)
    path = tmp_path / "r.sglkv"
    write_record(path, rec, block_tokens=16)
    h = read_header(path)
    # One byte of layer 1's V, token 20 (block 1 of 4).
    _flip(path, h.data_offset + 3 * h.layer_bytes + 20 * h.row_bytes + 5)
    with RecordFile(path, MODEL) as f:
        with pytest.raises(CorruptRecordError):
            f.read_layers(range(1, 2))
        with pytest.raises(CorruptRecordError):
            f.read_layers(range(1, 2), [21])
        # Untouched layers, and untouched blocks of the bad layer, verify fine.
        _, k0, _ = f.read_layers(range(0, 1))
        assert torch.equal(k0, rec.k[:1])
        _, _, v1 = f.read_layers(range(1, 2), [0, 63])
        assert torch.equal(v1, rec.v[1:2, [0, 63]])
    with pytest.raises(CorruptRecordError):
        read_record(path)


def test_corrupt_header_is_detected(tmp_path, record):
    path = tmp_path / "r.sglkv"
    write_record(path, record)
    _flip(path, 60)
    with pytest.raises(CorruptRecordError):
        read_header(path)


@pytest.mark.parametrize("keep", [0, 5, 30, 200, -1])
def test_truncation_is_detected(tmp_path, record, keep):
    path = tmp_path / "r.sglkv"
    write_record(path, record)
    size = path.stat().st_size
    os.truncate(path, size - 1 if keep == -1 else keep)
    with pytest.raises((TruncatedRecordError, CorruptRecordError)) as info:
        read_record(path)
    if keep in (-1, 0, 5, 30):
        assert isinstance(info.value, TruncatedRecordError)


def test_foreign_model_wrong_tokens_bad_magic_newer_version(tmp_path, record):
    path = tmp_path / "r.sglkv"
    write_record(path, record)
    with pytest.raises(ForeignModelError):
        read_record(path, OTHER_MODEL)
    with pytest.raises(TokenMismatchError):
        read_record(path, MODEL, token_ids=[t + 1 for t in record.token_ids])
    with pytest.raises(CorruptRecordError):
        read_record(path, MODEL, key="0" * 64)
    newer = tmp_path / "newer.sglkv"
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", FORMAT_VERSION + 1)
    newer.write_bytes(bytes(raw))
    with pytest.raises(UnsupportedFormatError):
        read_record(newer)
    other = tmp_path / "other.sglkv"
    other.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(BadMagicError):
        read_header(other)
    for cls in (ForeignModelError, TokenMismatchError, UnsupportedFormatError, BadMagicError):
        assert issubclass(cls, StoreError)


def _with_header(path, **changes):
    """``path``'s record with header fields changed and the header checksum made valid
    again: a well-formed record of another build or configuration."""
    import hashlib

    import msgpack

    raw = path.read_bytes()
    _, version, header_len, _ = struct.unpack("<8sII32s", raw[:48])
    header = msgpack.unpackb(raw[48 : 48 + header_len], raw=False)
    body = msgpack.packb({**header, **changes}, use_bin_type=True)
    prefix = struct.pack("<8sII32s", MAGIC, version, len(body), hashlib.sha256(body).digest())
    path.write_bytes(prefix + body + raw[48 + header_len :])


def test_a_valid_record_of_another_build_is_foreign_or_newer_never_corrupt(tmp_path, record):
    # Deleting such a file as corrupt would destroy another server's cache in a shared dir.
    path = tmp_path / "r.sglkv"
    write_record(path, record)
    _with_header(path, dtype="float8_e4m3fn", model=OTHER_MODEL)
    with pytest.raises(ForeignModelError):
        read_header(path, MODEL)
    _with_header(path, model=MODEL)
    with pytest.raises(UnsupportedFormatError):
        read_header(path, MODEL)


@pytest.mark.parametrize(
    "changes",
    [
        {"dtype": ["float32"]},
        {"dtype": 4},
        {"num_tokens": float("inf")},
        {"num_tokens": True},
        {"num_layers": 1 << 40},
        {"head_dim": "64"},
        {"layer_start": -1},
        {"token_ids": [-1, 2]},
        {"token_ids": "ab"},
        {"token_ids_hash": 7},
        {"ranking": [1.0]},
        {"k_sums": "not a list"},
        {"v_sums": [3]},
        {"key": None},
        {"context_contents": "ab"},
        {"context_contents": ["not a digest"]},
        {"context_contents": [7]},
    ],
    ids=lambda c: "-".join(f"{k}={v!r}" for k, v in c.items()),
)
def test_a_header_field_of_the_wrong_type_or_range_is_corrupt(tmp_path, record, changes):
    # A header whose checksum holds is still anyone's bytes (a shared directory or
    # store): its fields must read as a corrupt record, never raise something else.
    path = tmp_path / "r.sglkv"
    write_record(path, record)
    _with_header(path, **changes)
    with pytest.raises(CorruptRecordError):
        read_header(path, MODEL)
    with pytest.raises(CorruptRecordError):
        read_record(path, MODEL)


@pytest.mark.parametrize("fail_on", ["write", "fsync"])
def test_failed_write_leaves_nothing(tmp_path, record, monkeypatch, fail_on):
    calls = {"n": 0}
    real_write = os.write

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] >= 2:  # after part of the file is written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def failing_fsync(fd):
        raise OSError(errno.EIO, "I/O error")

    if fail_on == "write":
        monkeypatch.setattr(os, "write", failing_write)
    else:
        monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        write_record(tmp_path / "r.sglkv", record)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cancel_at", ["start", "write", "rename"])
def test_a_cancelled_write_leaves_nothing(tmp_path, record, monkeypatch, cancel_at):
    """Cancelled before any byte, after part of the file, or after the fsync (just before
    the rename): WriteCancelled, and neither the file nor its temp file is left."""
    cancel = threading.Event()
    real_write, real_fsync = os.write, os.fsync

    def write(fd, data):
        if cancel_at == "write":
            cancel.set()
        return real_write(fd, data)

    def fsync(fd):
        real_fsync(fd)
        if cancel_at == "rename":
            cancel.set()

    if cancel_at == "start":
        cancel.set()
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(WriteCancelled):
        write_record(tmp_path / "r.sglkv", record, cancel=cancel)
    assert list(tmp_path.iterdir()) == []


def test_write_ignores_a_cancel_set_after_the_rename(tmp_path, record):
    cancel = threading.Event()
    size = write_record(tmp_path / "r.sglkv", record, cancel=cancel)
    cancel.set()
    assert size == (tmp_path / "r.sglkv").stat().st_size
    assert same_record(read_record(tmp_path / "r.sglkv", MODEL), record)


def test_temp_names_record_their_writer(tmp_path):
    name = tmp_name(tmp_path / ("a" * 64 + ".sglkv"))
    owner = tmp_owner(name)
    assert name.startswith(TMP_PREFIX) and owner is not None
    assert owner.pid == os.getpid() and "." not in owner.host
    assert tmp_owner(f"{TMP_PREFIX}{'a' * 64}.sglkv.{'f' * 32}") is None  # older writer
    assert tmp_owner("a" * 64 + ".sglkv") is None
