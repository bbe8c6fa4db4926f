"""Disk tier: one chunk file per segment under a root directory, with a capacity, LRU or
LFU eviction, and an index rebuilt from the files at start-up.

Paths come only from key digests (``<root>/<2 hex>/<64 hex>.sglkv``). A bad file is
never served: it is counted, dropped from the index (and deleted when it is ours and
broken) and reported as a miss. A failed write leaves no file and no index entry.
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

import torch

from sgl_pic.store.base import (
    ChunkKV,
    ChunkStore,
    EvictResult,
    LayerKV,
    StoreStats,
    check_key,
    register_store,
)
from sgl_pic.store.errors import (
    BadMagicError,
    CorruptRecordError,
    ForeignModelError,
    RecordShapeError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from sgl_pic.store.eviction import EntryMeta, check_policy, eviction_order
from sgl_pic.store.format import (
    SUFFIX,
    TMP_PREFIX,
    RecordFile,
    encode_record,
    file_name,
    read_header,
    write_record,
)

# (error kind in stats, delete the file?). Foreign and newer files may belong to another
# model or a newer binary sharing the directory, so they are skipped, not deleted.
_BAD_FILE: dict[type[StoreError], tuple[str, bool]] = {
    BadMagicError: ("corrupt", True),
    CorruptRecordError: ("corrupt", True),
    TruncatedRecordError: ("truncated", True),
    TokenMismatchError: ("token_mismatch", True),
    ForeignModelError: ("foreign_model", False),
    UnsupportedFormatError: ("newer_format", False),
}


@dataclass(frozen=True)
class DiskStoreConfig:
    """root:               directory of the tier (created if missing).
    capacity_bytes:     file bytes (headers included) the tier may hold, >= 0.
    policy:             "lru" or "lfu" (see HostStoreConfig).
    block_tokens:       tokens per payload checksum block: smaller blocks make sparse
                        reads verify (and touch) fewer bytes, at 32 header bytes each.
    stale_tmp_seconds:  temp files older than this at start-up are leftovers of a crash
                        and are removed; younger ones may be another process's write.
    """

    root: str
    capacity_bytes: int
    policy: str = "lru"
    block_tokens: int = 32
    stale_tmp_seconds: float = 3600.0

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


@register_store
class DiskStore(ChunkStore):
    """Chunk files on a local disk. ``get`` and ``get_layers`` return fresh copies read
    through mmap and verified against the file's checksums."""

    name: ClassVar[str] = "disk"

    def __init__(self, config: DiskStoreConfig, model_digest: str) -> None:
        self.config = config
        self.model_digest = check_key(model_digest)
        self.root = Path(config.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, EntryMeta] = {}
        self._clock = itertools.count()
        self._used = 0
        self._reserved = 0
        self._pending: set[str] = set()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._rebuild_index()

    def path_of(self, key: str) -> Path:
        """Where ``key``'s file lives: derived from the digest alone."""
        name = file_name(key)
        return self.root / name[:2] / name

    def _rebuild_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for path in sorted(sub.iterdir()):
                if path.name.startswith(TMP_PREFIX):
                    self._remove_stale_tmp(path, now)
                    continue
                if not path.name.endswith(SUFFIX):
                    continue
                try:
                    header = read_header(path, self.model_digest)
                    if path.name != file_name(header.key) or sub.name != path.name[:2]:
                        raise CorruptRecordError(f"{path.name} holds key {header.key[:12]}")
                    st = path.stat()
                except StoreError as exc:
                    self._count_bad(exc, path)
                    continue
                except OSError:
                    self._errors["unreadable"] += 1
                    continue
                found.append((st.st_mtime, header.key, st.st_size))
        # Oldest files first, so recency order survives a restart approximately.
        for mtime, key, size in sorted(found):
            self._entries[key] = EntryMeta(size, next(self._clock), mtime)
            self._used += size
        if self._used > self.config.capacity_bytes:
            self._delete_files(self._evict_locked(self._used - self.config.capacity_bytes))

    def _remove_stale_tmp(self, path: Path, now: float) -> None:
        try:
            if now - path.stat().st_mtime > self.config.stale_tmp_seconds:
                path.unlink()
                self._counts["stale_tmp_removed"] += 1
        except OSError:
            pass

    def _count_bad(self, exc: StoreError, path: Path | None) -> None:
        kind, delete = next(
            (v for cls, v in _BAD_FILE.items() if isinstance(exc, cls)), ("corrupt", True)
        )
        self._errors[kind] += 1
        if delete and path is not None:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                self._errors["unlink_error"] += 1

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def _begin_read(self, key: str) -> Path | None:
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            entry.touch(self._clock)
        return self.path_of(key)

    def _fail_read(self, key: str, path: Path, exc: Exception) -> None:
        """Turn a failed read into a miss: count it, forget the entry, maybe delete."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
            self._counts["misses"] += 1
            if isinstance(exc, FileNotFoundError):
                self._errors["vanished"] += 1
            elif isinstance(exc, StoreError):
                self._count_bad(exc, path)
            else:
                self._errors["unreadable"] += 1

    def get(self, key: str, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        path = self._begin_read(key)
        if path is None:
            return None
        try:
            with RecordFile(path, self.model_digest, key, token_ids) as f:
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

    def put(self, record: ChunkKV) -> bool:
        if record.model_digest != self.model_digest:
            with self._lock:
                self._errors["foreign_model"] += 1
                self._counts["rejected_puts"] += 1
            return False
        with self._lock:
            if record.key in self._entries or record.key in self._pending:
                return True
        enc = encode_record(record, self.config.block_tokens)
        with self._lock:
            if record.key in self._entries or record.key in self._pending:
                return True
            need = self._used + self._reserved + enc.size - self.config.capacity_bytes
            evicted = self._evict_locked(need) if need > 0 else []
            fits = self._used + self._reserved + enc.size <= self.config.capacity_bytes
            if fits:
                self._reserved += enc.size
                self._pending.add(record.key)
            else:
                self._counts["rejected_puts"] += 1
        self._delete_files(evicted)
        if not fits:
            return False
        path = self.path_of(record.key)
        err: OSError | None = None
        try:
            path.parent.mkdir(exist_ok=True)
            write_record(path, enc)
        except OSError as exc:
            # write_record removed its temp file; the record simply is not persisted.
            err = exc
        with self._lock:
            self._reserved -= enc.size
            self._pending.discard(record.key)
            if err is None:
                self._entries[record.key] = EntryMeta(enc.size, next(self._clock), time.time())
                self._used += enc.size
                self._counts["puts"] += 1
            else:
                self._errors["write_error"] += 1
                if err.errno == errno.ENOSPC:
                    self._errors["enospc"] += 1
        return err is None

    def _evict_locked(self, nbytes: int) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        freed = 0
        for key in eviction_order(self._entries, self.config.policy):
            if freed >= nbytes:
                break
            entry = self._entries.pop(key)
            self._used -= entry.nbytes
            freed += entry.nbytes
            out.append((key, entry.nbytes))
            self._counts["evictions"] += 1
            self._counts["evicted_bytes"] += entry.nbytes
        return out

    def _delete_files(self, evicted: list[tuple[str, int]]) -> None:
        # Unlinking is safe under open readers: their mmap keeps the inode alive.
        for key, _ in evicted:
            try:
                self.path_of(key).unlink(missing_ok=True)
            except OSError:
                with self._lock:
                    self._errors["unlink_error"] += 1

    def evict(self, nbytes: int) -> EvictResult:
        with self._lock:
            evicted = self._evict_locked(nbytes)
        self._delete_files(evicted)
        return EvictResult(tuple(k for k, _ in evicted), sum(n for _, n in evicted))

    def lock(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.locks += 1
            return True

    def unlock(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.locks > 0:
                entry.locks -= 1

    def stats(self) -> StoreStats:
        with self._lock:
            c = self._counts
            return StoreStats(
                entries=len(self._entries),
                bytes_used=self._used,
                capacity_bytes=self.config.capacity_bytes,
                hits=c["hits"],
                misses=c["misses"],
                puts=c["puts"],
                rejected_puts=c["rejected_puts"],
                evictions=c["evictions"],
                evicted_bytes=c["evicted_bytes"],
                bytes_read=c["bytes_read"],
                errors=MappingProxyType(dict(self._errors)),
            )
