"""Disk tier: one chunk file per segment under a root directory, with a capacity, LRU, LFU or
GDSF eviction, and an index rebuilt from the files at start-up.

Paths come only from key digests (``<root>/<2 hex>/<64 hex>.sglkv``). A bad file is
never served: it is counted, dropped from the index (and deleted when it is ours and
broken) and reported as a miss. Whatever else sits at a record's path (a FIFO, socket,
device node, directory or symlink) is never opened for reading, so it can neither block
nor crash the store: it is a bad file too. A failed write leaves no file and no index
entry.

Writes are atomic (``format.write_record``: temp file, fsync, rename, directory fsync),
which is the guarantee when the process is killed mid-write (SGLang SIGKILLs a scheduler
that outlives its shutdown grace, and its children die with it): only the temp file can
be left, and start-up removes it, counted as the error kind "leftover_tmp".

A full disk lowers the tier's capacity. The configured ``capacity_bytes`` is a ceiling,
not a promise: the file system may fill first (a small tmpfs, a quota, other users). A
write failing with ENOSPC or EDQUOT lowers the effective capacity to the bytes the tier
then holds or has reserved for writes in flight, so the next put evicts by the policy to
make room rather than failing like this one for the rest of the process. The failed put
itself is not retried (it returns False, counted as now); a put that still fails after
its eviction lowers the capacity again, so the tier converges on what the disk can hold.
The capacity grows back towards the configured one when ``os.statvfs`` reports free
space again: checked by a put at most every ``regrow_interval_s`` seconds while lowered,
and by half the free space each time (the rest is left to other writers, ours in flight
among them: ``disk.capacity``). ``stats().capacity_bytes`` is the effective capacity.

Where the parts live: the start-up scan ``disk.scan``, bad files and failed reads
``disk.files``, the capacity after a full disk ``disk.capacity``, the file format
``record_*`` (``format``), the index and eviction ``bounded``. ``DiskStore`` stays over
250 lines: each of its reads and writes pairs a step on the index, under the index's lock,
with a file step outside it (access, read, forget on failure; reserve, write, then index
or drop), so both halves share the lock and the index's state; split into two classes,
one would take the other's lock and private state.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch

from sgl_pic.store.base import (
    ChunkKV,
    EvictResult,
    LayerKV,
    RecordLayout,
    check_key,
    register_store,
)
from sgl_pic.store.bounded import BoundedStore
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.disk.capacity import CapacityRegrowth
from sgl_pic.store.disk.files import FULL, NO_SPACE, count_failed_read
from sgl_pic.store.disk.scan import scan_root
from sgl_pic.store.errors import (
    RecordShapeError,
    StoreError,
)
from sgl_pic.store.eviction import check_policy
from sgl_pic.store.private import LooseModes, is_loose, make_private_dir, report
from sgl_pic.store.record.encode import EncodedRecord, encode_record
from sgl_pic.store.record.header import RecordHeader, file_name
from sgl_pic.store.record.read import RecordFile, read_header
from sgl_pic.store.record.write import WriteCancelled, write_record


class _PutTarget(NamedTuple):
    """What a ``DiskStore.put`` writes: the key, its file size, the deletion mark it
    obtained the record at (``since``), and the record's namespace and content."""

    key: str
    size: int
    since: int
    namespace: str
    content: str


class _Reservation(NamedTuple):
    """The outcome of ``DiskStore._reserve``: ``answer`` is the put's result when it
    ends there, None when the write goes ahead; ``evicted``: (key, size) of files to
    delete outside the lock."""

    answer: bool | None
    evicted: list[tuple[str, int]]


@dataclass(frozen=True)
class DiskStoreConfig:
    """root:               directory of the tier (created if missing).
    capacity_bytes:     file bytes (headers included) the tier may hold, >= 0.
    policy:             "lru", "lfu" or "gdsf" (see HostStoreConfig).
    block_tokens:       tokens per payload checksum block: smaller blocks make sparse
                        reads verify (and touch) fewer bytes, at 32 header bytes each.
    stale_tmp_seconds:  temp files older than this at start-up are leftovers of a crash
                        and are removed; younger ones are removed when their name says
                        they were written on this host by a process that no longer
                        runs, else kept (another process's write in progress).
    namespace_max_bytes: file bytes one namespace (tenant) may hold, 0 for no cap
                        (``sgl_pic.store.eviction``: fair share).
    """

    root: str
    capacity_bytes: int
    policy: str = "lru"
    block_tokens: int = 32
    stale_tmp_seconds: float = 3600.0
    namespace_max_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("root must be a directory path")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        check_policy(self.policy)
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.stale_tmp_seconds < 0:
            raise ValueError(f"stale_tmp_seconds must be >= 0, got {self.stale_tmp_seconds}")
        if self.namespace_max_bytes < 0:
            raise ValueError(f"namespace_max_bytes must be >= 0, got {self.namespace_max_bytes}")


@register_store
class DiskStore(BoundedStore):
    """Chunk files on a local disk. ``get`` and ``get_layers`` return fresh copies read
    through mmap and verified against the file's checksums.

    Error kinds in ``stats().errors`` besides the bad-file ones (among them "not_regular":
    a FIFO, socket, device, directory or symlink at a record's path): "write_error",
    "enospc", "unlink_error", "unreadable", "vanished", and "leftover_tmp" (a temp file of
    a killed writer, removed at start-up). A full disk lowers ``stats().capacity_bytes``
    (see the module docstring)."""

    name: ClassVar[str] = "disk"
    # How often, at most, a put asks the file system for free space while the capacity
    # is lowered: a statvfs per put would cost little, but regrowing a capacity that
    # just failed would only buy another failed write.
    regrow_interval_s: ClassVar[float] = 10.0

    def __init__(
        self,
        config: DiskStoreConfig,
        model_digest: str,
        layout: RecordLayout | None = None,
        deletions: DeletionLog | None = None,
    ) -> None:
        """layout: the KV layout (the serving pool's) every file must have; a file of
        another is a bad file (error kind "layout_mismatch", deleted). None checks none.
        deletions: the deletion log puts check (shared with the host tier above)."""
        super().__init__(
            model_digest,
            config.capacity_bytes,
            config.policy,
            layout,
            config.namespace_max_bytes,
            deletions,
        )
        self.config = config
        self.root = Path(config.root)
        make_private_dir(self.root)
        self._root_mode = os.stat(self.root).st_mode
        self._loose_records = 0  # found at start-up, for ``private.report``
        # Keys being written -> their file size, reserved against the capacity until the
        # write ends (their sum is the reservation).
        self._pending: dict[str, int] = {}
        self._pending_ns: dict[str, str] = {}  # their namespaces, for the caps
        # Set by abort_writes (shutdown): writes in flight stop, later ones are refused.
        self._abort = threading.Event()
        self._regrowth = CapacityRegrowth(self.root, config.capacity_bytes, self.regrow_interval_s)
        self._rebuild_index()
        self.at_rest = LooseModes(
            self._root_mode if is_loose(self._root_mode) else None, self._loose_records
        )
        report(self.root, self.at_rest)

    def path_of(self, key: str) -> Path:
        """Where ``key``'s file lives: derived from the digest alone."""
        name = file_name(key)
        return self.root / name[:2] / name

    def _rebuild_index(self) -> None:
        scan = scan_root(
            self.root, self.model_digest, self.layout, self.config.stale_tmp_seconds, self._errors
        )
        self._loose_records = scan.loose_records
        for found in scan.found:  # oldest first, so recency order survives a restart
            self._add_locked(found.key, found.size, found.mtime, found.namespace, found.content)
        if self._used > self._capacity:
            self._delete_files(self._evict_locked(self._used - self._capacity))

    def _checked(self, header: RecordHeader) -> RecordHeader:
        """``header`` if its KV layout is the store's; else ``LayoutMismatchError``."""
        if self.layout is not None:
            self.layout.check_header(header)
        return header

    def _begin_read(self, key: str) -> Path | None:
        check_key(key)
        with self._lock:
            if not self._access_locked(key):
                return None
        return self.path_of(key)

    def _fail_read(self, key: str, path: Path, exc: Exception, miss: bool = True) -> None:
        """Turn a failed read into a miss: count it, forget the entry, maybe delete.
        ``miss=False`` for a peek, which counts no access of either kind."""
        with self._lock:
            self._forget_locked(key)
            if miss:
                self._counts["misses"] += 1
            count_failed_read(exc, path, self._errors)

    def peek_header(self, key: str, token_ids: Sequence[int] | None = None) -> RecordHeader | None:
        """The file's checked header (model, key, tokens), without counting an access or
        reading the payload; None if not held or the header is unusable.

        An unusable header is handled as a failed ``get``: counted, forgotten and deleted
        when ours. Leaving it for the next read is not enough: callers (the scheduler's
        match) take a None here as a miss and never read, while the key still held would
        stop the chunk from being stored afresh, so it would miss forever."""
        check_key(key)
        if not self.contains(key):
            return None
        path = self.path_of(key)
        try:
            return self._checked(read_header(path, self.model_digest, key, token_ids))
        except (StoreError, OSError, ValueError) as exc:
            self._fail_read(key, path, exc, miss=False)
            return None

    def peek(self, key: str) -> ChunkKV | None:
        """The whole record if held and sound, without counting an access or touching its
        recency (a bad file is left for the next ``get`` to count and drop)."""
        check_key(key)
        if not self.contains(key):
            return None
        try:
            with RecordFile(self.path_of(key), self.model_digest, key, None) as f:
                self._checked(f.header)
                return f.read_record()
        except (StoreError, OSError, ValueError):
            return None

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        path = self._begin_read(key)
        if path is None:
            return None
        try:
            with RecordFile(path, self.model_digest, key, token_ids) as f:
                self._checked(f.header)
                record = f.read_record()
        except (StoreError, OSError, ValueError) as exc:
            # ValueError: mmap of a file emptied underneath us.
            self._fail_read(key, path, exc)
            return None
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += record.nbytes
        return record

    def get_layers(
        self,
        key: str,
        layers: range,
        token_indices: torch.Tensor | Sequence[int] | None = None,  # [n] int
        token_ids: Sequence[int] | None = None,
    ) -> LayerKV | None:
        path = self._begin_read(key)
        if path is None:
            return None
        try:
            with RecordFile(path, self.model_digest, key, token_ids) as f:
                self._checked(f.header)
                idx, k, v = f.read_layers(layers, token_indices)
                row = f.header.row_bytes
        except RecordShapeError:
            # The caller asked for layers or tokens the record lacks: its bug, not the
            # file's; the entry stays.
            with self._lock:
                self._counts["misses"] += 1
            raise
        except (StoreError, OSError, ValueError) as exc:
            self._fail_read(key, path, exc)
            return None
        moved = 2 * len(layers) * idx.numel() * row
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += moved
        return LayerKV(key, layers, idx, k, v, moved)

    def abort_writes(self) -> None:
        """Stop writing, for shutdown: a ``put`` writing now stops before its rename,
        removes its temp file and raises ``WriteCancelled``; later puts return False
        (counted as "refused_after_abort"). Reads keep working. Irreversible."""
        self._abort.set()

    @property
    def writes_aborted(self) -> bool:
        return self._abort.is_set()

    def put(self, record: ChunkKV, since: int | None = None) -> bool:
        """Write ``record``'s file (atomically) unless held or it does not fit; True when
        the file is there afterwards. After ``abort_writes``: False without writing, or
        ``WriteCancelled`` from a write that the abort stopped (no file left).

        since: ``deletions.seq`` when the caller obtained ``record`` (a write-back queued
        earlier; default now). A deletion logged after it that matches the record drops
        it, also one logged while the file was being written (the file is removed)."""
        if since is None:
            since = self.deletions.seq
        if not self._accepts_model(record):
            return False
        if self._abort.is_set():
            with self._lock:
                self._counts["refused_after_abort"] += 1
            return False
        with self._lock:
            if record.key in self._entries or record.key in self._pending:
                return True
        enc = encode_record(record, self.config.block_tokens)
        target = _PutTarget(record.key, enc.size, since, record.namespace, record.content())
        self._maybe_regrow()
        reservation = self._reserve(target)
        self._delete_files(reservation.evicted)
        if reservation.answer is not None:
            return reservation.answer
        err = self._write_file(target.key, enc)
        return self._finish_put(target, err)

    def _reserve(self, target: _PutTarget) -> _Reservation:
        """The index step of a put, under the lock: make room for ``target`` by the
        policy and reserve its size in ``_pending``. ``answer`` is put's result when it
        ends here (True: held already; False: deleted since ``target.since``, or no room)
        and None when the write goes ahead; ``evicted``: files the caller deletes."""
        key, size, ns = target.key, target.size, target.namespace
        with self._lock:
            if key in self._entries or key in self._pending:
                return _Reservation(True, [])
            if self._deleted_since_locked(target.since, ns, target.content):
                return _Reservation(False, [])
            ns_pending = sum(n for k, n in self._pending.items() if self._pending_ns[k] == ns)
            evicted, fits = self._make_room_locked(
                sum(self._pending.values()) + size, ns, ns_pending + size
            )
            if fits:
                self._pending[key] = size
                self._pending_ns[key] = ns
        return _Reservation(None if fits else False, evicted)

    def _unreserve_locked(self, key: str) -> None:
        """Drops ``key``'s reservation (its write ended)."""
        del self._pending[key]
        del self._pending_ns[key]

    def _write_file(self, key: str, enc: EncodedRecord) -> OSError | None:
        """Writes ``enc`` at ``key``'s path (atomically), outside the lock; the OSError
        that failed it, else None. A write the abort stopped releases the reservation,
        is counted as "cancelled_writes" and raises ``WriteCancelled``."""
        path = self.path_of(key)
        try:
            make_private_dir(path.parent)
            write_record(path, enc, cancel=self._abort)
        except OSError as exc:
            # write_record removed its temp file; the record simply is not persisted.
            return exc
        except WriteCancelled:
            with self._lock:
                self._unreserve_locked(key)
                self._counts["cancelled_writes"] += 1
            raise
        return None

    def _finish_put(self, target: _PutTarget, err: OSError | None) -> bool:
        """The index step after the write, under the lock: release the reservation, then
        index the file (True), remove it if a deletion matched meanwhile (False), or
        count the failed write ``err`` and lower the capacity on a full disk (False)."""
        with self._lock:
            self._unreserve_locked(target.key)
            if err is None and self._deleted_since_locked(
                target.since, target.namespace, target.content
            ):
                # Deleted while being written: the file goes (under the lock, so no
                # later put of this key can have written it).
                self._delete_files([(target.key, target.size)], locked=True)
                return False
            if err is None:
                self._add_locked(
                    target.key, target.size, namespace=target.namespace, content=target.content
                )
                self._counts["puts"] += 1
            else:
                self._errors["write_error"] += 1
                if err.errno in NO_SPACE:
                    self._errors["enospc"] += 1
                if err.errno in FULL:
                    self._lower_capacity_locked()
        return err is None

    def _held_locked(self) -> int:
        """Bytes held and reserved by writes in flight."""
        return self._used + sum(self._pending.values())

    def _lower_capacity_locked(self) -> None:
        """The disk is full: hold no more than is held now (``CapacityRegrowth.lowered``)."""
        self._capacity = self._regrowth.lowered(self._capacity, self._held_locked())

    def _maybe_regrow(self) -> None:
        """Let a lowered capacity grow back (``CapacityRegrowth``)."""
        with self._lock:
            if not self._regrowth.due(self._capacity):
                return
        free = self._regrowth.free_bytes()
        if free is None:
            return
        with self._lock:
            self._capacity = self._regrowth.grown(self._capacity, self._held_locked(), free)

    def _delete_files(self, evicted: list[tuple[str, int]], locked: bool = False) -> None:
        # Unlinking is safe under open readers: their mmap keeps the inode alive.
        for key, _ in evicted:
            try:
                self.path_of(key).unlink(missing_ok=True)
            except OSError:
                if locked:
                    self._errors["unlink_error"] += 1
                else:
                    with self._lock:
                        self._errors["unlink_error"] += 1

    def _dropped_locked(self, keys: list[str]) -> None:
        # Deleted files go under the lock: a put of the same key (the tenant sent the
        # document again) cannot have written its new file yet, so it is never the one
        # removed. Open readers keep the old inode until they close it.
        self._delete_files([(k, 0) for k in keys], locked=True)

    def evict(self, nbytes: int) -> EvictResult:
        with self._lock:
            evicted = self._evict_locked(nbytes)
        self._delete_files(evicted)
        return EvictResult(tuple(k for k, _ in evicted), sum(n for _, n in evicted))
