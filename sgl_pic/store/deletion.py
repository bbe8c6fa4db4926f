"""What a deletion names, and what it removed.

An operator deletes by tenant (namespace), by content (the tokens of chunks), or both
(that tenant's copies of that content). Every tier stores one record per segment
(``keys.segment_keys``), and a record's key is a chained hash that cannot be recomputed
without the model fingerprint and the preceding segments, so a deletion names content by
the digest of each segment's own tokens: a tier compares it with the digest of the
record's ``token_ids``, which every record carries. A segment shared by two chunks is
deleted with either (deleting more than asked is safe; serving deleted tokens is not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sgl_pic.store.base import CONTENT_SEPARATOR, hash_token_ids


def content_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 hex of one segment's token ids, encoded as ``sgl_pic.keys`` encodes them
    (little-endian uint32 each); record headers carry the same digest as
    ``token_ids_hash``. Pure; safe from any thread."""
    return hash_token_ids(token_ids)


def segment_contents(token_ids: Sequence[int], segment_tokens: int) -> frozenset[str]:
    """The content digests of the segments a chunk of ``token_ids`` is split into, split
    exactly as ``keys.segment_keys`` splits it (consecutive runs of ``segment_tokens``)."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    if len(token_ids) == 0:
        raise ValueError("a chunk needs at least one token")
    return frozenset(
        content_digest(token_ids[start : start + segment_tokens])
        for start in range(0, len(token_ids), segment_tokens)
    )


# Most segment contents one order names: its shared-store tombstone (about 70 bytes per
# digest) must stay under the log's 1 MiB per tombstone, or the order would stop half-way
# on a server sharing a store and fail the same way each time it is sent again.
MAX_CONTENTS = 8192


@dataclass(frozen=True)
class Deletion:
    """One deletion order: records whose namespace is in ``namespaces`` (None: any) AND
    whose segment content digest is in ``contents`` (None: any). At least one of the two
    is given: a deletion of everything is ``/flush_cache``'s job, not this one's.

    namespaces: isolation namespaces ("" the default, else 64-digit hex, as records
                carry them).
    contents:   ``content_digest`` values of segment token ids.
    """

    namespaces: frozenset[str] | None = None
    contents: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.namespaces is None and self.contents is None:
            raise ValueError("a Deletion names namespaces, contents or both")
        for name, value in (("namespaces", self.namespaces), ("contents", self.contents)):
            if value is None:
                continue
            if not isinstance(value, frozenset):
                value = frozenset(value)
                object.__setattr__(self, name, value)
            if not value:
                raise ValueError(f"a Deletion's {name} is None (any) or non-empty")
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"a Deletion's {name} are strings")
        if self.contents is not None and len(self.contents) > MAX_CONTENTS:
            raise ValueError(
                f"a deletion names at most {MAX_CONTENTS} segments of content, this one "
                f"{len(self.contents)}: delete in smaller batches"
            )

    def matches_namespace(self, namespace: str) -> bool:
        """Whether a record of ``namespace`` can match (its content not yet checked)."""
        return self.namespaces is None or namespace in self.namespaces

    def matches_digest(self, namespace: str, digest: str) -> bool:
        """``matches`` for a record whose content (``base.record_content``: its digest,
        and those of the chunk it was encoded after) is already known."""
        if not self.matches_namespace(namespace):
            return False
        contents = self.contents
        return contents is None or any(d in contents for d in digest.split(CONTENT_SEPARATOR))

    def matches(self, namespace: str, token_ids: Sequence[int]) -> bool:
        """Whether a record of ``namespace`` holding ``token_ids`` (one segment) is
        deleted by this order."""
        if not self.matches_namespace(namespace):
            return False
        return self.contents is None or content_digest(token_ids) in self.contents


class DeleteReport(NamedTuple):
    """What one tier removed: ``records`` entries holding ``nbytes`` payload bytes (locked
    entries count here too: they leave the index at once, their bytes when unlocked)."""

    records: int
    nbytes: int
