"""Chunk-hashed, non-prefix nodes of the radix cache: independent chunk KV in SGLang's pool.

Each node is one segment of a chunk (DARIC 3.3.2): its key chains over the chunk's earlier
segments (``sgl_pic.keys.segment_keys``), its parent is the previous segment (None for a
chunk's first), and its KV lives in slots taken from SGLang's token-to-KV allocator, keys
post-RoPE at positions 0..n-1 of the chunk, exactly as phase 1 wrote them. So the
allocator accounts for every cached chunk token; ``ChunkRadixCache`` reports them as
evictable (unlocked) or protected (locked) beside SGLang's own prefix nodes.

Keys name the isolation namespace of the request that stored the chunk
(``sgl_pic.core.tenants``): a lookup finds only its own namespace's nodes.

A node is immutable once inserted: hits are copied out into the request's own slots and
re-rotated there. Eviction takes leaves only, never a locked node, in the table's policy
order (``node_eviction.NodeEviction``).

Fair share (``namespace_max_tokens``): no namespace holds more slots than its cap; an
insert past it evicts only inside that namespace, and an insert short of room evicts the
inserting namespace's own nodes before any other's, so one tenant's churn never pushes out
another's nodes while it has nodes of its own to give up.

``ChunkNodeTable`` stays over the class-size limit: it is the one owner of the node index
and its counts, so every change of them (insert, lock, evict, delete, re-key on new weights,
clear) is a method of it; split, the counts would have two owners.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sgl_pic.engine.node_eviction import NodeEviction
from sgl_pic.keys import ModelFingerprint, SegmentKey, segment_keys
from sgl_pic.store.base import record_content
from sgl_pic.store.deletion import Deletion, content_digest

Keys = tuple[SegmentKey, ...]  # a chunk's segment keys, in order


@dataclass
class ChunkNode:
    """One cached segment. Mutable bookkeeping only; ``slots`` never change.

    slots:    # [allocated] int64 pool slots; the first ``num_tokens`` hold the KV, the
              rest pad the allocation to whole pages.
    ranking:  # [num_tokens] CacheTune ranking, or None.
    namespace: the isolation namespace it was stored under ("" the default).
    content:  ``store.base.record_content`` of its token ids and of the first chunk it was
              encoded after, if any: what a deletion by content matches.
    deleted:  taken out of the index by a deletion while locked; its slots go back to the
              allocator when the last lock is released.
    """

    key: str
    parent: str | None
    slots: torch.Tensor
    num_tokens: int
    ranking: torch.Tensor | None
    namespace: str = ""
    content: str = ""
    deleted: bool = False
    lock_ref: int = 0
    children: int = 0
    last_access: int = 0
    hits: int = 0
    priority: float = 0.0  # GDSF's (the table's policy may ignore it)

    @property
    def kv_slots(self) -> torch.Tensor:
        """# [num_tokens] the slots holding the segment's KV."""
        return self.slots[: self.num_tokens]

    @property
    def allocated(self) -> int:
        return int(self.slots.numel())


class ChunkHit(NamedTuple):
    """All segments of one chunk, in order, and the chunk's ranking (None if any segment
    lacks one)."""

    nodes: tuple[ChunkNode, ...]
    ranking: torch.Tensor | None

    @property
    def slots(self) -> torch.Tensor:
        """# [n] pool slots of the chunk's KV, token order."""
        return torch.cat([n.kv_slots for n in self.nodes])


class NodeDeleteReport(NamedTuple):
    """What ``ChunkNodeTable.delete`` took out of the index: ``records`` nodes holding
    ``tokens`` slots (of which ``pending_tokens`` are locked: freed when unlocked)."""

    records: int
    tokens: int
    pending_tokens: int


class ChunkNodeTable:
    """The chunk nodes of one scheduler's cache.

    allocator: SGLang's token-to-KV allocator (``alloc(n)`` -> slots or None, ``free``,
               ``page_size``); every slot a node holds came from it and returns to it.
    capacity_tokens: most slots the nodes may hold together; inserting beyond it evicts
               unlocked leaves first and gives up (returns None) if that is not enough.
    policy:    eviction order among unlocked leaves: "lru", "lfu" or "gdsf" (``eviction``,
               a ``NodeEviction``, applies it and counts the nodes it evicted).
    namespace_max_tokens: most slots one isolation namespace's nodes may hold (0: no cap);
               see the module's note on fair share.

    Not thread-safe: SGLang's scheduler thread owns it, as it owns the prefix tree.
    """

    def __init__(
        self,
        allocator: Any,
        fingerprint: ModelFingerprint,
        segment_tokens: int,
        capacity_tokens: int,
        policy: str = "lru",
        namespace_max_tokens: int = 0,
    ) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        if namespace_max_tokens < 0:
            raise ValueError(f"namespace_max_tokens must be >= 0, got {namespace_max_tokens}")
        self.namespace_max_tokens = namespace_max_tokens
        self.allocator = allocator
        self.fingerprint = fingerprint
        self.segment_tokens = segment_tokens
        self.capacity_tokens = capacity_tokens
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self._nodes: dict[str, ChunkNode] = {}
        self.eviction = NodeEviction(self._nodes, self._remove, policy)  # type: ignore[arg-type]
        self._clock = itertools.count(1)
        self._allocated = 0
        self._locked = 0  # slots of nodes with lock_ref > 0
        self._by_namespace: dict[str, int] = {}  # slots held per namespace (>0 only)
        # Bumped by every clear (SGLang's flush_cache): work begun before a flush, such as a
        # promotion still loading, must not refill the table after it.
        self.generation = 0

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def allocated_tokens(self) -> int:
        return self._allocated

    @property
    def protected_tokens(self) -> int:
        """Slots of locked nodes: in use by a running request."""
        return self._locked

    @property
    def evictable_tokens(self) -> int:
        return self._allocated - self._locked

    def contains(self, key: str) -> bool:
        return key in self._nodes

    def namespace_tokens(self, namespace: str) -> int:
        """Slots the nodes of ``namespace`` hold."""
        return self._by_namespace.get(namespace, 0)

    def tokens_by_namespace(self) -> dict[str, int]:
        """Slots held per isolation namespace (those holding any), deleted nodes still
        locked included."""
        return dict(self._by_namespace)

    def keys(self, token_ids: Sequence[int], namespace: str = "", context: str = "") -> Keys:
        fingerprint, segment_tokens = self.fingerprint, self.segment_tokens
        return segment_keys(list(token_ids), fingerprint, segment_tokens, namespace, context)

    def match(
        self, token_ids: Sequence[int], namespace: str = "", context: str = ""
    ) -> ChunkHit | None:
        """The chunk's nodes in ``namespace``, encoded after ``context`` ("" alone,
        ``keys.segment_keys``), if every segment is held (touching them), else None."""
        keys = self.keys(token_ids, namespace, context)
        nodes = [self._nodes.get(k.digest) for k in keys]
        if any(n is None for n in nodes):
            return None
        held = tuple(n for n in nodes if n is not None)
        now = next(self._clock)
        for n in held:
            n.last_access = now
            n.hits += 1
            n.priority = self.eviction.priority(n.hits + 1, n.allocated)
        rankings = [n.ranking for n in held]
        ranking = None if any(r is None for r in rankings) else torch.cat(rankings)  # type: ignore[arg-type]
        return ChunkHit(held, ranking)

    def insert(
        self,
        token_ids: Sequence[int],
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
        context: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> tuple[tuple[ChunkNode, ...], Keys] | None:
        """Allocates the segments of ``namespace`` (encoded after ``context``, whose first
        chunk's contents are ``context_contents``) not yet held and links them in; returns
        (new nodes, their keys) for the caller to fill with KV before anything reads them
        (the scheduler thread does both, so nothing can read them in between). None when
        the slots cannot be had within the capacity; nothing is changed then."""
        keys = self.keys(token_ids, namespace, context)
        missing = [k for k in keys if k.digest not in self._nodes]
        if not missing:
            return (), ()
        need = sum(self._padded(k.end - k.start) for k in missing)
        # The chunk's segments already held are its new nodes' ancestors: they must
        # survive the eviction below, so they are locked for it.
        held = [self._nodes[k.digest] for k in keys if k.digest in self._nodes]
        self.lock(held)
        try:
            if not self.eviction.make_room(self, need, namespace):
                return None
            slots = self.allocator.alloc(need)
        finally:
            self.unlock(held)
        if slots is None:
            return None
        now = next(self._clock)
        new: list[ChunkNode] = []
        at = 0
        by_digest = {k.digest: i for i, k in enumerate(keys)}
        for k in missing:
            n = k.end - k.start
            take = self._padded(n)
            i = by_digest[k.digest]
            own = content_digest(list(token_ids[k.start : k.end]))
            node = ChunkNode(
                key=k.digest,
                parent=keys[i - 1].digest if i > 0 else None,
                slots=slots[at : at + take],
                num_tokens=n,
                ranking=None if ranking is None else ranking[k.start : k.end].clone(),
                namespace=namespace,
                content=record_content(own, context_contents),
                last_access=now,
                priority=self.eviction.priority(1, take),
            )
            at += take
            self._nodes[k.digest] = node
            self._allocated += take
            self._by_namespace[namespace] = self._by_namespace.get(namespace, 0) + take
            if node.parent is not None and node.parent in self._nodes:
                self._nodes[node.parent].children += 1
            new.append(node)
        return tuple(new), tuple(missing)

    def discard(self, nodes: Sequence[ChunkNode]) -> None:
        """Takes back nodes ``insert`` just returned, before anything read them (their
        KV could not be written): their slots go back to the allocator, and the chunk is
        held no more than before."""
        for n in reversed(nodes):  # a new node's children are later new nodes
            if self._nodes.get(n.key) is n:
                self._remove(n)

    def _padded(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def lock(self, nodes: Sequence[ChunkNode]) -> None:
        for n in nodes:
            if n.lock_ref == 0:
                self._locked += n.allocated
            n.lock_ref += 1

    def unlock(self, nodes: Sequence[ChunkNode]) -> None:
        for n in nodes:
            if n.lock_ref <= 0:
                raise RuntimeError(f"chunk node {n.key[:12]} unlocked more than locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked -= n.allocated
                if n.deleted:
                    self._free(n)

    def evict(self, num_tokens: int) -> int:
        """Frees unlocked leaf nodes in policy order until ``num_tokens`` slots are back in
        the allocator or none is left; returns the slots freed."""
        return self.eviction.evict(num_tokens)

    def _remove(self, node: ChunkNode) -> int:
        self._unlink(node)
        return self._free(node)

    def _unlink(self, node: ChunkNode) -> None:
        """Takes ``node`` out of the index (its slots stay allocated)."""
        del self._nodes[node.key]
        if node.parent is not None and node.parent in self._nodes:
            self._nodes[node.parent].children -= 1

    def _free(self, node: ChunkNode) -> int:
        """Gives the slots of a node out of the index back to the allocator."""
        self._allocated -= node.allocated
        left = self._by_namespace.get(node.namespace, 0) - node.allocated
        if left > 0:
            self._by_namespace[node.namespace] = left
        else:
            self._by_namespace.pop(node.namespace, None)
        self.allocator.free(node.slots)
        return node.allocated

    def delete(self, deletion: Deletion) -> NodeDeleteReport:
        """Takes every node ``deletion`` matches out of the index at once, with the nodes
        chained after them (which could never hit again). An unlocked node's slots go back
        to the allocator now, a locked one's when the request holding it unlocks it (its
        KV is already being copied out; nothing can find it any more). Bumps
        ``generation``, so a promotion under way cannot bring a deleted chunk back."""
        self.generation += 1
        doomed = {
            k for k, n in self._nodes.items() if deletion.matches_digest(n.namespace, n.content)
        }
        # Successors of a deleted segment: a node's parent precedes it in insertion
        # order, so one pass in that order finds whole chains.
        for k, n in self._nodes.items():
            if n.parent is not None and n.parent in doomed:
                doomed.add(k)
        return self._drop(doomed)

    def rekey(self, fingerprint: ModelFingerprint) -> NodeDeleteReport:
        """Keys chunks under ``fingerprint`` from now on (new weights) and drops every node,
        as ``delete`` does; bumps ``generation``, so no promotion of the old lands."""
        self.generation += 1
        self.fingerprint = fingerprint
        return self._drop(set(self._nodes))

    def _drop(self, doomed: set[str]) -> NodeDeleteReport:
        tokens = pending = 0
        for k in [k for k in self._nodes if k in doomed]:
            node = self._nodes[k]
            tokens += node.allocated
            if node.lock_ref:
                pending += node.allocated
                node.deleted = True
                self._unlink(node)
            else:
                self._remove(node)
        return NodeDeleteReport(len(doomed), tokens, pending)

    def clear(self, free: bool) -> None:
        """Drops every node; ``free=False`` when the allocator is being cleared anyway
        (SGLang's flush_cache resets the tree, then the allocator)."""
        if any(n.lock_ref for n in self._nodes.values()):
            raise RuntimeError("cannot clear chunk nodes while a request holds them")
        if free:
            for n in list(self._nodes.values()):
                self._remove(n)
        self._nodes.clear()
        self._by_namespace.clear()
        self._allocated = 0
        self._locked = 0
        self.eviction.reset()
        self.generation += 1


def take_slots(allocator: Any, n: int, make_room: Callable[[int], int]) -> torch.Tensor | None:
    """# [m] slots from SGLang's token-to-KV allocator, m = ``n`` rounded up to whole pages;
    when it is short, ``make_room(m)`` frees what it can and the allocator is asked once
    more. None when there are none. For slots the engine holds outside the chunk nodes (a
    split request's scratch, a cut chunk's encoding)."""
    page = int(getattr(allocator, "page_size", 1) or 1)
    need = -(-n // page) * page
    slots = allocator.alloc(need)
    if slots is None and make_room(need) > 0:
        slots = allocator.alloc(need)
    return slots
