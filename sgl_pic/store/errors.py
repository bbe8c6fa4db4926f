"""Errors of the chunk store: one base class, one subclass per way a record can be bad.

Tiers catch these and report a miss; only the file-format functions raise them to
callers, so a caller can tell a foreign model from a corrupted byte.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every chunk-store error."""


class BadMagicError(StoreError):
    """The file does not start with the chunk-file magic: not a chunk file at all."""


class TruncatedRecordError(StoreError):
    """The file is shorter (or longer) than its header says."""


class CorruptRecordError(StoreError):
    """A header or payload checksum does not match the bytes on disk."""


class ForeignModelError(StoreError):
    """The record was written for another model fingerprint."""


class TokenMismatchError(StoreError):
    """The record's token ids are not the ones the caller expected for this key."""


class UnsupportedFormatError(StoreError):
    """The file was written by a newer (or unknown) format version."""


class LayoutMismatchError(StoreError):
    """A well-formed record of this model's fingerprint whose KV layout (layers, KV heads,
    head dim, dtype) is not the one the serving model's KV pool holds: planted, or written
    by a bug. Never served; the tier counts it ("layout_mismatch") and drops it."""


class RecordShapeError(StoreError):
    """A record's tensors, ranking or token ids disagree in shape, or a request
    names layers or tokens the record does not hold."""
