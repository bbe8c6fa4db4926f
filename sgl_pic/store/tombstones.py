"""Deletion tombstones in the shared store: an append-only log every server sharing it reads.

The backend offers no listing (Mooncake cannot list keys), so a deletion cannot find the
records other servers wrote. Instead it appends a tombstone, and every server treats a
record a tombstone covers as missing (and removes it) when it meets it.

Log layout: tombstone i is the object ``slot_key(i)``, claimed with ``put_if_absent`` (the
first writer of a slot wins; a loser reads the winner's tombstone and tries the next
slot). A reader holds ``read``, the number of slots it has read, and polls slot ``read``:
one ``size`` call when nothing is new. Tombstones are msgpack maps, never pickles.

Which records a tombstone covers: every record header written to the shared store holds
``tombstones_seen``, the count its writer had applied to its own tiers when it took the
record (``published``). Tombstone i covers a record iff i >= its ``tombstones_seen`` and
the deletion matches the record's namespace and content: a record written after the
deletion (the tenant sent the document again) is served.

One log for every model and setting sharing the store: a tenant that leaves, deleted by
namespace on a server of one model, leaves every model's cache. A content deletion names
token ids of one tokenizer; other models' records simply do not match it. Every server
reads every tombstone (a few hundred bytes each).

Limits: the store may evict a tombstone object (Mooncake evicts by watermark like any
object); a reader that had not read that slot yet stops at the gap until a new deletion
claims it again, so run the store with room to spare. Memory keeps the last ``keep``
tombstones; a record that predates all of them is treated as covered (a miss, recomputed).
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import deque
from collections.abc import Callable

import msgpack

from sgl_pic.store.base import check_key
from sgl_pic.store.deletion import Deletion
from sgl_pic.store.object_backend import PutOutcome
from sgl_pic.store.store_link import StoreLink

TOMBSTONE_VERSION = 1
_SLOT_DOMAIN = b"sgl_pic.tombstone\0"
# A tombstone larger than this is not one of ours (a content deletion of ~10k segments).
_MAX_TOMBSTONE_BYTES = 1 << 20


def slot_key(index: int) -> str:
    """The store key of tombstone ``index``: a digest in a domain of its own, so it is
    never a record's key."""
    return hashlib.sha256(_SLOT_DOMAIN + index.to_bytes(8, "little")).hexdigest()


def encode_tombstone(d: Deletion, writer: str) -> bytes:
    """msgpack bytes of ``d``; ``writer`` tells a writer its own slot from a rival's."""
    return msgpack.packb(
        {
            "v": TOMBSTONE_VERSION,
            "writer": writer,
            "namespaces": None if d.namespaces is None else sorted(d.namespaces),
            "contents": None if d.contents is None else sorted(d.contents),
        },
        use_bin_type=True,
    )


def decode_tombstone(raw: bytes) -> tuple[Deletion, str]:
    """(deletion, writer) of a tombstone; ValueError for anything else."""
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"unreadable tombstone: {exc}") from exc
    if not isinstance(h, dict) or h.get("v") != TOMBSTONE_VERSION:
        raise ValueError("not a tombstone of this version")

    def names(field: str, check: Callable[[str], object]) -> frozenset[str] | None:
        value = h.get(field)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"tombstone {field} is not a list of strings")
        for v in value:
            check(v)
        return frozenset(value)

    namespaces = names("namespaces", lambda v: v == "" or check_key(v))
    contents = names("contents", check_key)
    writer = h.get("writer")
    if not isinstance(writer, str):
        raise ValueError("tombstone writer is not a string")
    return Deletion(namespaces, contents), writer


class Tombstones:
    """This server's view of the tombstone log. Backend calls go through ``link`` and
    raise what it raises (``BackendUnavailable`` while the store is down).

    ``poll`` and ``append`` are called from the scheduler thread (one at a time, under
    ``_io``); ``covers`` and ``published`` from any thread (reads, background writers).
    """

    def __init__(self, link: StoreLink, keep: int = 65536) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.link = link
        self._io = threading.Lock()  # one poll or append at a time
        self._lock = threading.Lock()  # guards the fields below
        self._read = 0  # slots [0, _read) read
        self._published = 0  # tombstones applied to this server's tiers
        self._kept: deque[tuple[int, Deletion]] = deque(maxlen=keep)
        self._writer = uuid.uuid4().hex
        self.bad = 0  # slots that held no readable tombstone (skipped)

    @property
    def read(self) -> int:
        """Slots read so far (each one a tombstone, or a bad slot skipped)."""
        with self._lock:
            return self._read

    @property
    def published(self) -> int:
        """What a writer taking a record now puts in its header as ``tombstones_seen``."""
        with self._lock:
            return self._published

    def publish(self) -> None:
        """Every tombstone read so far has been applied to this server's tiers: records
        taken from now on are written as having seen them."""
        with self._lock:
            self._published = self._read

    def _take(self, index: int, raw: bytes) -> Deletion | None:
        try:
            d, writer = decode_tombstone(raw)
        except ValueError:
            d, writer = None, ""
        with self._lock:
            self._read = index + 1
            if d is None:
                self.bad += 1
            else:
                self._kept.append((index, d))
        return None if d is None or writer == self._writer else d

    def _read_slot(self, index: int) -> bytes | None:
        key = slot_key(index)
        size = self.link.call(lambda b: b.size(key))
        if size is None:
            return None
        if size > _MAX_TOMBSTONE_BYTES:
            return b""  # read as a bad slot
        data = self.link.call(lambda b: b.read_ranges(key, [(0, size)]))
        return None if data is None else data.tobytes()

    def poll(self) -> list[Deletion]:
        """Read the tombstones appended since the last poll; the deletions other servers
        made (this server's own are skipped). One backend call when none is new."""
        out: list[Deletion] = []
        with self._io:
            while True:
                index = self.read
                raw = self._read_slot(index)
                if raw is None:
                    return out
                d = self._take(index, raw)
                if d is not None:
                    out.append(d)

    def append(self, d: Deletion) -> tuple[int, list[Deletion]]:
        """Claim the next free slot for ``d``; (its index, the other servers' deletions
        read on the way, which the caller applies like ``poll``'s)."""
        raw = encode_tombstone(d, self._writer)
        if len(raw) > _MAX_TOMBSTONE_BYTES:
            raise ValueError(f"a tombstone of {len(raw)} bytes; delete in smaller batches")
        others = self.poll()
        with self._io:
            while True:
                index = self.read
                key = slot_key(index)
                outcome = self.link.call(lambda b, k=key: b.put_if_absent(k, [raw]))
                # Our bytes name our writer id, so no rival writes the same bytes: STORED
                # means the slot is ours (the master refuses a second writer of a key).
                got = raw if outcome is PutOutcome.STORED else self._read_slot(index)
                if got is None:
                    continue  # the rival's tombstone vanished: try the slot again
                theirs = self._take(index, got)
                if got == raw:
                    return index, others
                if theirs is not None:
                    others.append(theirs)

    def covers(self, seen: int, namespace: str, content: str) -> bool:
        """Whether a tombstone read so far, numbered ``seen`` or later, matches a record
        of ``namespace`` and content digest ``content``. A record older than every
        tombstone kept is covered when older ones were forgotten."""
        with self._lock:
            if seen >= self._read:
                return False
            if self._kept and self._kept[0][0] > seen and len(self._kept) == self._kept.maxlen:
                return True  # tombstones it may predate were forgotten: assume the worst
            newer = [d for i, d in self._kept if i >= seen]
        return any(d.matches_digest(namespace, content) for d in newer)
