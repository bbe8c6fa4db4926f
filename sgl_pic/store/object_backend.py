"""Byte-level clients of a distributed object store that several servers share.

``SharedStore`` (``sgl_pic.store.shared.store``) keeps chunk records there in the disk tier's
file layout (``sgl_pic.store.format``); this module only moves bytes: set-if-absent puts,
existence and size queries, byte-range reads (so a sparse load moves only the blocks it
verifies) and removal. ``MooncakeBackend`` speaks to Mooncake Store (the master plus the
TCP transport of ``mooncake-transfer-engine-non-cuda``), SGLang's cross-instance KV tier.

Store URLs: ``mooncake://HOST:PORT`` names the master's RPC port; its HTTP metadata server
is taken to listen on PORT + 1 (as ``sgl_pic.store.shared.service`` starts it) unless the
query says ``?metadata=http://...``.
"""

from __future__ import annotations

import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import numpy as np

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that change what we do.
_MC_OBJECT_NOT_FOUND = -704
_MC_OBJECT_EXISTS = -705
# At or below this, and INTERNAL_ERROR (-1): transfer, RPC, metadata and client-state
# failures, i.e. the store (or our link to it) is down rather than the object bad.
_MC_UNREACHABLE_BELOW = -800
_MC_INTERNAL = -1


class BackendUnavailable(Exception):
    """The store cannot be reached (not connected yet, RPC or transfer failure)."""


class BackendError(Exception):
    """The store answered, but with an error other than "not found" (e.g. a range
    outside the object, which for us means a truncated object)."""


class PutOutcome(Enum):
    STORED = "stored"  # this call wrote it (or lost a race to an identical writer)
    PRESENT = "present"  # already held: written by this or another server before


@dataclass(frozen=True)
class StoreAddress:
    """Where a shared store is. scheme: the backend's registered name."""

    scheme: str
    host: str
    port: int
    metadata_url: str

    @classmethod
    def parse(cls, url: str) -> StoreAddress:
        """Raises ValueError naming the problem for anything but ``SCHEME://HOST:PORT``
        of a known backend (plus its documented query)."""
        parts = urlsplit(url)
        if parts.scheme not in BACKENDS:
            raise ValueError(
                f"shared store URL {url!r}: scheme must be one of {', '.join(BACKENDS)}"
            )
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"shared store URL {url!r}: bad port") from exc
        if not parts.hostname or port is None:
            raise ValueError(f"shared store URL {url!r} needs a host and a port")
        query = parse_qs(parts.query)
        unknown = set(query) - {"metadata"}
        if unknown:
            raise ValueError(f"shared store URL {url!r}: unknown options {sorted(unknown)}")
        metadata = query.get("metadata", [f"http://{parts.hostname}:{port + 1}/metadata"])[0]
        return cls(parts.scheme, parts.hostname, port, metadata)


class ObjectBackend(ABC):
    """A client of one shared object store. Methods may be called from several threads.
    Every method except ``connect`` raises BackendUnavailable when the store cannot be
    reached, and BackendError for any other failure of the store; none retries."""

    scheme: ClassVar[str]

    @abstractmethod
    def connect(self) -> None:
        """Join the store; may block for as long as the store is down. Raises
        BackendUnavailable if it gives up."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Bytes of the object ``key``, or None if the store does not hold it."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held now (changes nothing)."""

    @abstractmethod
    def put_if_absent(self, key: str, parts: Sequence[bytes | np.ndarray]) -> PutOutcome:
        """Store the concatenation of ``parts`` as ``key`` unless ``key`` is held; the
        first writer of a key wins and later writers change nothing (keys are content
        hashes, so every writer of a key writes the same bytes)."""

    @abstractmethod
    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> np.ndarray | None:
        """# [sum of lengths] uint8: the byte ranges (offset, length) of ``key``,
        concatenated; None if the store does not hold ``key``."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """Drop ``key`` (also while other clients read it); a missing key is a no-op."""

    @abstractmethod
    def close(self) -> None:
        """Leave the store."""


class MooncakeBackend(ObjectBackend):
    """Mooncake Store over TCP. This client mounts no memory of its own (segment size 0):
    objects live in the store's own holder process, so a server going away takes no
    shared chunk with it. Ranged reads land in one registered staging buffer, taken
    under a lock, grown when a read needs more."""

    scheme: ClassVar[str] = "mooncake"

    def __init__(self, address: StoreAddress, local_host: str = "127.0.0.1") -> None:
        self.address = address
        self.local_host = local_host
        self._client: Any = None
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_lock = threading.Lock()

    def _store(self) -> Any:
        if self._client is None:
            raise BackendUnavailable("not connected")
        return self._client

    def connect(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel is a declared dependency; say so plainly
            raise BackendUnavailable(
                "mooncake-transfer-engine-non-cuda is not installed (scripts/install.sh)"
            ) from exc
        # Mooncake's setup() holds the GIL while it retries an absent master (about 90 s
        # in 0.3.13), which would stall every thread of the server; so it is called only
        # once both of the store's ports answer.
        meta = urlsplit(self.address.metadata_url)
        for host, port in (
            (self.address.host, self.address.port),
            (meta.hostname or self.address.host, meta.port or 80),
        ):
            try:
                socket.create_connection((host, port), timeout=1.0).close()
            except OSError as exc:
                raise BackendUnavailable(f"{host}:{port} does not answer: {exc}") from exc
        client = MooncakeDistributedStore()
        rc = client.setup(
            self.local_host,
            self.address.metadata_url,
            0,  # global segment: none, see the class docstring
            16 << 20,  # local buffer for Mooncake's own copies
            "tcp",
            "",
            f"{self.address.host}:{self.address.port}",
        )
        if rc != 0:
            raise BackendUnavailable(f"mooncake setup failed with code {rc}")
        self._client = client
        with self._staging_lock:
            self._staging_buffer(4 << 20)  # registered now, while the store answers

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc >= 0:
            return
        if rc == _MC_INTERNAL or rc <= _MC_UNREACHABLE_BELOW:
            raise BackendUnavailable(f"{what}: mooncake code {rc}")
        raise BackendError(f"{what}: mooncake code {rc}")

    def size(self, key: str) -> int | None:
        rc = int(self._store().get_size(key))
        if rc == _MC_OBJECT_NOT_FOUND:
            return None
        self._check(rc, "get_size")
        return rc

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store().batch_is_exist(list(keys))
        out = []
        for rc in codes:
            self._check(int(rc), "batch_is_exist")
            out.append(int(rc) == 1)
        return out

    def put_if_absent(self, key: str, parts: Sequence[bytes | np.ndarray]) -> PutOutcome:
        store = self._store()
        if self.exists([key])[0]:
            return PutOutcome.PRESENT
        # The master refuses a second PutStart of a key (OBJECT_ALREADY_EXISTS), so two
        # servers racing here store the object once.
        rc = int(store.put_parts(key, *[memoryview(p).cast("B") for p in parts]))
        if rc == _MC_OBJECT_EXISTS:
            return PutOutcome.PRESENT
        self._check(rc, "put_parts")
        return PutOutcome.STORED

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        """The registered staging buffer, at least ``nbytes`` long (caller holds the lock)."""
        if self._staging.size < nbytes:
            store = self._store()
            if self._staging.size:
                store.unregister_buffer(self._staging.ctypes.data)
            fresh = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            if int(store.register_buffer(fresh.ctypes.data, fresh.nbytes)) != 0:
                # Mooncake answers INVALID_PARAMS here while its master is gone.
                raise BackendUnavailable("cannot register the staging buffer")
            self._staging = fresh
        return self._staging

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> np.ndarray | None:
        total = sum(n for _, n in ranges)
        with self._staging_lock:
            buf = self._staging_buffer(total)
            dst, pos = [], 0
            for _, n in ranges:
                dst.append(pos)
                pos += n
            codes = self._store().get_into_ranges(
                [buf.ctypes.data],
                [[key]],
                [[dst]],
                [[[off for off, _ in ranges]]],
                [[[n for _, n in ranges]]],
            )
            got = [int(c) for c in codes[0][0]]
            if any(c == _MC_OBJECT_NOT_FOUND for c in got):
                return None
            for c, (_, n) in zip(got, ranges, strict=True):
                self._check(c, "get_into_ranges")
                if c != n:
                    raise BackendError(f"short range read: {c} of {n} bytes")
            return buf[:total].copy()

    def remove(self, key: str) -> None:
        rc = int(self._store().remove(key, True))  # force: past other readers' leases
        if rc != _MC_OBJECT_NOT_FOUND:
            self._check(rc, "remove")

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


BACKENDS: Mapping[str, type[ObjectBackend]] = MappingProxyType(
    {MooncakeBackend.scheme: MooncakeBackend}
)


def make_backend(url: str) -> ObjectBackend:
    """An unconnected client of the store at ``url`` (ValueError for a bad URL)."""
    address = StoreAddress.parse(url)
    return BACKENDS[address.scheme](address)
