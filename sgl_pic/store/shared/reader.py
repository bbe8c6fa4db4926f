"""Reads of the shared tier, on the scheduler thread: a key's header is read once and kept
(``HeaderCache``), checked against the model, the caller's tokens and the serving KV
layout, and against the deletion tombstones; payloads move as the checksum blocks that
hold the wanted tokens (``shared.blocks``), verified before any byte is returned.

A bad object (corrupt, truncated, of another KV layout or tokens) is counted, removed
from the store and answered as a miss; one of another model or a newer format is counted
and left alone. A record a later tombstone covers is a miss, and the object goes. While
the store is unreachable every read is a miss at once (``StoreLink``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sgl_pic.store.base import ChunkKV, LayerKV, RecordLayout, layer_offsets, normalize_indices
from sgl_pic.store.errors import (
    CorruptRecordError,
    ForeignModelError,
    LayoutMismatchError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from sgl_pic.store.object_backend import BackendError, BackendUnavailable
from sgl_pic.store.record.header import (
    PREFIX_BYTES,
    RecordHeader,
    check_expectations,
    parse_header,
)
from sgl_pic.store.shared.blocks import read_blocks
from sgl_pic.store.shared.counts import SharedCounts
from sgl_pic.store.shared.deletion import SharedDeletions
from sgl_pic.store.shared.headers import HeaderCache
from sgl_pic.store.store_link import StoreLink

logger = logging.getLogger(__name__)

# First read of an object: the prefix and, for records of usual size, the whole header.
_HEAD_READ = 64 << 10

_Read = tuple[torch.Tensor, torch.Tensor, int]  # k, v, bytes moved


class SharedReader:
    """The read side of ``SharedStore`` (whose ``contains``, ``peek_ranking``, ``get``
    and ``get_layers`` these are). layout: the KV layout every object must have (None
    checks none)."""

    def __init__(
        self,
        link: StoreLink,
        headers: HeaderCache,
        deletions: SharedDeletions,
        counts: SharedCounts,
        model_digest: str,
        layout: RecordLayout | None,
    ) -> None:
        self.link = link
        self.headers = headers
        self.deletions = deletions
        self.counts = counts
        self.model_digest = model_digest
        self.layout = layout

    def contains(self, key: str) -> bool:
        header = self.headers.get(key, touch=False)
        if header is not None:
            if not self.deletions.covers(header):
                return True
            self.headers.forget(key)  # deleted since it was read; the store may hold a newer one
        try:
            return self.link.call(lambda b: b.exists([key])[0])
        except (BackendUnavailable, BackendError):
            return False

    def _bad(self, key: str, exc: StoreError | BackendError) -> None:
        """Count a bad object; remove it unless it is another model's (never ours to drop)."""
        kind = {
            CorruptRecordError: "corrupt",
            TruncatedRecordError: "truncated",
            ForeignModelError: "foreign_model",
            LayoutMismatchError: "layout_mismatch",
            TokenMismatchError: "token_mismatch",
            UnsupportedFormatError: "newer_format",
            BackendError: "truncated",
        }.get(type(exc), "corrupt")
        self.counts.error(kind)
        self.headers.forget(key)
        logger.warning("sgl_pic: shared record %s is bad (%s): %s", key[:12], kind, exc)
        if kind in ("foreign_model", "newer_format"):
            return
        with contextlib.suppress(BackendUnavailable, BackendError):
            self.link.call(lambda b: b.remove(key))

    def _header(self, key: str, token_ids: Sequence[int] | None) -> RecordHeader | None:
        """The key's checked header (cached), or None on a miss, a bad object (counted) or
        a record a deletion tombstone covers (counted "tombstoned", removed). Raises
        BackendUnavailable."""
        for attempt in range(2):
            header = self.headers.get(key)
            cached = header is not None
            if header is None:
                header = self._fetch_header(key)
                if header is None:
                    return None
            try:
                check_expectations(header, self.model_digest, key, token_ids)
                if self.layout is not None:
                    self.layout.check_header(header)
            except StoreError as exc:  # other tokens, another key, or another KV layout
                self._bad(key, exc)
                return None
            if not self.deletions.covers(header):
                return header
            self.headers.forget(key)
            if cached and not attempt:
                continue  # cached before the tombstone: the object may be a newer one now
            # Written before a deletion that covers it: a miss, and the object goes.
            self.counts.add("tombstoned")
            with contextlib.suppress(BackendUnavailable, BackendError):
                self.link.call(lambda b: b.remove(key))
            return None
        return None

    def _fetch_header(self, key: str) -> RecordHeader | None:
        """The header read from the store and cached; None on a miss or a bad object."""
        size = self.link.call(lambda b: b.size(key))
        if size is None:
            return None
        head = self.link.call(lambda b: b.read_ranges(key, [(0, min(size, _HEAD_READ))]))
        if head is None:
            return None
        try:
            header = self._parse(key, head.tobytes(), size)
        except (StoreError, BackendError) as exc:
            self._bad(key, exc)
            return None
        self.headers.put(key, header)
        return header

    def _parse(self, key: str, head: bytes, size: int) -> RecordHeader:
        def body(n: int) -> bytes:
            if PREFIX_BYTES + n <= len(head):
                return head[PREFIX_BYTES : PREFIX_BYTES + n]
            more = self.link.call(lambda b: b.read_ranges(key, [(PREFIX_BYTES, n)]))
            if more is None:
                raise TruncatedRecordError("object vanished while its header was read")
            return more.tobytes()

        return parse_header(head[:PREFIX_BYTES], body, size, self.model_digest)

    def peek_ranking(
        self, key: str, token_ids: Sequence[int] | None = None
    ) -> torch.Tensor | None | bool:
        """# [num_tokens] the record's ranking, None if it has none, or False when the key
        is not usable here (missing, bad, unreachable). Counts no hit or miss."""
        try:
            header = self._header(key, token_ids)
        except (BackendUnavailable, BackendError):
            return False
        return False if header is None else header.ranking

    def _read(
        self,
        key: str,
        header: RecordHeader,
        offsets: range,
        idx: np.ndarray,  # [n] int64 sorted unique token indices
    ) -> _Read | None:
        """(k, v # [len(offsets), n, heads, head_dim], bytes moved) of the tokens ``idx``
        of record layers ``offsets``, every touched block verified; None on a miss."""
        return read_blocks(self.link, key, header, offsets, idx)

    def _read_checked(
        self,
        key: str,
        token_ids: Sequence[int] | None,
        read: Callable[[RecordHeader], _Read | None],
    ) -> tuple[RecordHeader | None, _Read | None]:
        """(header, ``read(header)``), or (None, None) on a miss. A payload that fails its
        checks against a cached header is read again once with a fresh header before it
        counts as bad: the store may have evicted the object and another server stored the
        key anew (recomputed KV need not be the same bytes). Raises what ``read`` raises."""
        for attempt in range(2):
            cached = key in self.headers
            header = self._header(key, token_ids)
            if header is None:
                return None, None
            try:
                return header, read(header)
            except (CorruptRecordError, TruncatedRecordError, BackendError):
                if attempt or not cached:
                    raise
                self.headers.forget(key)
        raise AssertionError("unreachable")

    def _load(
        self,
        key: str,
        token_ids: Sequence[int] | None,
        read: Callable[[RecordHeader], _Read | None],
        bad: tuple[type[Exception], ...],
    ) -> tuple[RecordHeader, torch.Tensor, torch.Tensor] | None:
        """``get``'s and ``get_layers``' read: the header and K/V of ``key`` read by
        ``read``, counted as a hit, or None counted as a miss. Errors of the kinds ``bad``
        count the object as bad; any other propagates (the caller's mistake)."""
        header: RecordHeader | None = None
        res: _Read | None = None
        try:
            header, res = self._read_checked(key, token_ids, read)
        except (BackendUnavailable, BackendError) as exc:
            if isinstance(exc, BackendError):
                self._bad(key, exc)
        except bad as exc:
            self._bad(key, exc)
        else:
            if header is not None and res is None:
                self.headers.forget(key)
        if header is None or res is None:
            self.counts.add("misses")
            return None
        k, v, nbytes = res
        self.counts.add("hits")
        self.counts.add("bytes_read", nbytes)
        return header, k, v

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        def every(h: RecordHeader) -> _Read | None:
            return self._read(key, h, range(h.num_layers), np.arange(h.num_tokens, dtype=np.int64))

        got = self._load(key, token_ids, every, (StoreError,))
        if got is None:
            return None
        header, k, v = got
        return ChunkKV(
            key=key,
            model_digest=header.model_digest,
            token_ids=header.token_ids,
            k=k,
            v=v,
            ranking=header.ranking,
            layer_start=header.layer_start,
            namespace=header.namespace,
            context_contents=header.context_contents,
        )

    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        def read(h: RecordHeader) -> _Read | None:
            held = range(h.layer_start, h.layer_start + h.num_layers)
            offsets = layer_offsets(held, layers)  # RecordShapeError: the caller's mistake
            idx = normalize_indices(token_indices, h.num_tokens)
            return self._read(key, h, offsets, idx.numpy())

        got = self._load(key, token_ids, read, (CorruptRecordError, TruncatedRecordError))
        if got is None:
            return None
        header, k, v = got
        idx = normalize_indices(token_indices, header.num_tokens)
        moved = 2 * len(layers) * idx.numel() * header.row_bytes  # as the other tiers count
        return LayerKV(key, layers, idx, k, v, bytes_read=moved)
