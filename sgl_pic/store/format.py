"""The on-disk chunk file: a checksummed msgpack header, then raw per-layer tensor bytes.

Layout (all integers little-endian):

    offset 0   magic        8 bytes  b"SGLPICKV"
    offset 8   version      uint32   FORMAT_VERSION of the writer
    offset 12  header_len   uint32   bytes of the msgpack header
    offset 16  header_sha   32 bytes SHA-256 of the header bytes
    offset 48  header       msgpack map (see ``RecordHeader``)
    data_offset = header end rounded up to 4096 (page aligned, so mmap reads of one
                  layer touch only that layer's pages)
    payload    for each layer l of the record, in order:
                   K[l]  num_tokens * row_bytes   (row = one token: heads * head_dim)
                   V[l]  num_tokens * row_bytes
    file size  = data_offset + 2 * num_layers * num_tokens * row_bytes, exactly

The 48-byte prefix is fixed for every version, so a reader always recognises a newer
file before parsing its header. Checksums are SHA-256 per (layer, K or V, block of
``block_tokens`` tokens): a sparse read verifies just the blocks it touches and still
never returns an unverified byte. Nothing is pickled; tensors go through numpy buffers.

The header is ``record.header``; the payload encoding ``record.encode``; atomic writes and
temp files ``record.write``; checked reads ``record.read``. This module is their public
face: callers import the format from here.
"""

from __future__ import annotations

from sgl_pic.store.errors import RecordShapeError, StoreError
from sgl_pic.store.record.encode import EncodedRecord, encode_header, encode_record
from sgl_pic.store.record.header import (
    ALIGN,
    DIGEST_BYTES,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    SUFFIX,
    RecordHeader,
    file_name,
)
from sgl_pic.store.record.read import (
    NotRegularFileError,
    RecordFile,
    open_regular,
    read_header,
    read_record,
)
from sgl_pic.store.record.write import (
    TMP_PREFIX,
    TmpOwner,
    WriteCancelled,
    is_local_owner,
    tmp_name,
    tmp_owner,
    write_record,
)

__all__ = [
    "ALIGN",
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "SUFFIX",
    "TMP_PREFIX",
    "EncodedRecord",
    "NotRegularFileError",
    "RecordFile",
    "RecordHeader",
    "RecordShapeError",
    "StoreError",
    "TmpOwner",
    "WriteCancelled",
    "encode_header",
    "encode_record",
    "file_name",
    "is_local_owner",
    "open_regular",
    "read_header",
    "read_record",
    "tmp_name",
    "tmp_owner",
    "write_record",
]
