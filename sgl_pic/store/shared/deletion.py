"""Deletion in the shared tier: tombstones sent and read, the keys this server can remove
at once, and the marks writes carry so a deleted record never comes back.

One ``SharedDeletions`` belongs to one ``SharedStore``; ``delete`` and ``sync`` run on the
scheduler thread, ``covers``/``dropped``/``marks``/``wrote`` on any thread (reads and the
background writer).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from sgl_pic.store.deletion import DeleteReport, Deletion
from sgl_pic.store.deletion_log import DeletionLog
from sgl_pic.store.object_backend import BackendError, BackendUnavailable
from sgl_pic.store.record.header import RecordHeader
from sgl_pic.store.store_link import StoreLink
from sgl_pic.store.tombstones import Tombstones

logger = logging.getLogger(__name__)

# What a server knows of a key it could remove: (namespace, content digest, payload bytes).
Known = tuple[str, str, int]


class SharedDeletions:
    """link:     the shared store's link.
    keep:        tombstones kept in memory (``Tombstones``).
    remember:    keys this server wrote that it keeps to remove on a deletion.
    known:       the shared tier's cached headers as key -> ``Known`` (read under its lock).
    forget:      drops a key's cached header.
    """

    def __init__(
        self,
        link: StoreLink,
        keep: int,
        remember: int,
        known: Callable[[], Mapping[str, Known]],
        forget: Callable[[str], None],
    ) -> None:
        self.link = link
        self.tombstones = Tombstones(link, keep)
        self.log = DeletionLog()
        self._remember = remember
        self._known = known
        self._forget = forget
        self._lock = threading.Lock()
        self._written: OrderedDict[str, Known] = OrderedDict()
        self._unsent: list[Deletion] = []  # tombstones not appended yet (store down)
        self._unapplied: list[Deletion] = []  # others' tombstones read by ``delete``

    def marks(self) -> tuple[int, int]:
        """(``log.seq``, tombstones applied): taken when a write obtains its record; the
        first drops the write if a later deletion matches, the second goes in its header."""
        return self.log.seq, self.tombstones.published

    def dropped(self, since: int, namespace: str, content: str) -> bool:
        """Whether a deletion logged after ``since`` matches: the write is dropped."""
        return self.log.covers(since, namespace, content)

    def covers(self, header: RecordHeader) -> bool:
        """Whether a tombstone read so far, or a deletion not sent yet, covers a record."""
        ns, content = header.namespace, header.content
        if self.tombstones.covers(header.tombstones_seen, ns, content):
            return True
        with self._lock:
            unsent = list(self._unsent)
        return any(d.matches_digest(ns, content) for d in unsent)

    def wrote(self, key: str, namespace: str, content: str, nbytes: int) -> None:
        """This server stored ``key``: remembered (bounded) so a deletion removes it."""
        with self._lock:
            self._written[key] = (namespace, content, nbytes)
            while len(self._written) > self._remember:
                self._written.popitem(last=False)

    def _remove_known(self, d: Deletion) -> DeleteReport:
        known = dict(self._known())
        with self._lock:
            known.update(self._written)
            gone = {k: n for k, (ns, c, n) in known.items() if d.matches_digest(ns, c)}
            for k in gone:
                self._written.pop(k, None)
        for k in gone:
            self._forget(k)
            with contextlib.suppress(BackendUnavailable, BackendError):
                self.link.call(lambda b, k=k: b.remove(k))
        return DeleteReport(len(gone), sum(gone.values()))

    def _send(self, d: Deletion) -> bool:
        try:
            _, others = self.tombstones.append(d)
        except (BackendUnavailable, BackendError) as exc:
            logger.warning("sgl_pic: deletion tombstone not written yet: %s", exc)
            return False
        with self._lock:
            self._unapplied += others
        return True

    def _publish_if_applied(self) -> None:
        with self._lock:
            if not self._unapplied:
                # Every tombstone read is applied here: later writes postdate them.
                self.tombstones.publish()

    def delete(self, d: Deletion, logged: bool) -> DeleteReport:
        """See ``SharedStore.delete``."""
        if not logged:
            self.log.append(d)
        if self._send(d):
            self._publish_if_applied()
        else:
            with self._lock:
                self._unsent.append(d)
        return self._remove_known(d)

    def unsent(self) -> int:
        with self._lock:
            return len(self._unsent)

    def sync(self, apply: Callable[[Deletion], object] | None) -> tuple[Deletion, ...]:
        """See ``SharedStore.sync_deletions``."""
        with self._lock:
            unsent, self._unsent = self._unsent, []
        for i, d in enumerate(unsent):
            if not self._send(d):
                with self._lock:
                    self._unsent[:0] = unsent[i:]
                break
        try:
            polled = self.tombstones.poll()
        except (BackendUnavailable, BackendError):
            polled = []
        with self._lock:
            found, self._unapplied = [*self._unapplied, *polled], []
        for d in found:
            self.log.append(d)
            self._remove_known(d)
            if apply is not None:
                apply(d)
        self._publish_if_applied()
        return tuple(found)
