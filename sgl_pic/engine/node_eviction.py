"""Which chunk nodes go when slots are needed: ``NodeEviction``, the eviction order of one
``ChunkNodeTable`` (``sgl_pic.engine.chunk_nodes``).

Only unlocked leaves go (a segment whose successor is held stays, or the successor could
never hit again), in the table's policy order (``sgl_pic.store.eviction``: LRU, LFU, or
GDSF, which weighs recency, hits and size so a stream of novel chunks does not push out
the ones in steady use), optionally only within one namespace or one namespace's first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sgl_pic.store.eviction import check_policy, gdsf_priority


class EvictableNode(Protocol):
    """What eviction reads of a chunk node (``chunk_nodes.ChunkNode``)."""

    namespace: str
    lock_ref: int
    children: int
    last_access: int
    hits: int
    priority: float

    @property
    def allocated(self) -> int: ...


class Sizes(Protocol):
    """What making room reads of the table (``chunk_nodes.ChunkNodeTable``)."""

    capacity_tokens: int
    namespace_max_tokens: int
    allocator: Any  # SGLang's token-to-KV allocator (``available_size()``)

    @property
    def allocated_tokens(self) -> int: ...

    @property
    def evictable_tokens(self) -> int: ...

    def namespace_tokens(self, namespace: str) -> int: ...


class NodeEviction:
    """nodes:  the table's index (read, never changed here).
    remove(node): takes one node out of the table, returning the slots freed.
    policy:    "lru", "lfu" or "gdsf".

    ``age`` is GDSF's inflation value (the priority of the last node evicted); ``evicted``
    counts the nodes evicted (cumulative, for the metrics). Scheduler side, as the table."""

    def __init__(
        self,
        nodes: Mapping[str, EvictableNode],
        remove: Callable[[EvictableNode], int],
        policy: str = "lru",
    ) -> None:
        check_policy(policy)
        self.policy = policy
        self.age = 0.0
        self.evicted = 0
        self._nodes = nodes
        self._remove = remove

    def priority(self, hits: int, size: int) -> float:
        """GDSF's priority of a node with ``hits`` hits holding ``size`` slots, now."""
        return gdsf_priority(self.age, hits, size)

    def evict(self, num_tokens: int, only: str | None = None, first: str | None = None) -> int:
        """Frees unlocked leaf nodes in policy order until ``num_tokens`` slots are back or
        none is left, among nodes of namespace ``only`` (None: all), those of ``first``
        before any other's; returns the slots freed."""
        freed = 0
        while freed < num_tokens:
            victims = [
                n
                for n in self._nodes.values()
                if n.lock_ref == 0 and n.children == 0 and (only is None or n.namespace == only)
            ]
            if not victims:
                break
            if first is None:
                victims.sort(key=self.order)
            else:
                own = [n for n in victims if n.namespace == first]
                # Removing a leaf of ``first`` may expose its parent segment as a leaf:
                # evict only ``first``'s leaves this round and look again before any
                # other namespace's.
                victims = sorted(own, key=self.order) if own else sorted(victims, key=self.order)
            for n in victims:
                freed += self._remove(n)
                self.evicted += 1
                self.age = max(self.age, n.priority)
                if freed >= num_tokens:
                    break
        return freed

    def make_room(self, sizes: Sizes, need: int, namespace: str) -> bool:
        """Evicts what an insert of ``need`` slots into ``namespace`` needs: within the
        table's capacity, the namespace's cap (``namespace_max_tokens``: past it only the
        namespace's own nodes go) and the allocator's free slots. False, with nothing
        evicted, when even every unlocked node would not be enough."""
        own_over = 0
        if sizes.namespace_max_tokens:
            own_over = sizes.namespace_tokens(namespace) + need - sizes.namespace_max_tokens
            if own_over > self.evictable_in(namespace):
                return False
        over = sizes.allocated_tokens + need - sizes.capacity_tokens
        # Every unlocked node can go (locks cover whole chunks, so a locked node's
        # ancestors are locked too): refuse before evicting anything if that is not
        # enough, or the pool cannot give the slots even then.
        if over > sizes.evictable_tokens:
            return False
        short = need - (sizes.allocator.available_size() + max(over, 0))
        if short > sizes.evictable_tokens - max(over, 0):
            return False
        if own_over > 0:
            self.evict(own_over, only=namespace)
            over = sizes.allocated_tokens + need - sizes.capacity_tokens
            short = need - (sizes.allocator.available_size() + max(over, 0))
        if over > 0 or short > 0:
            cap = bool(sizes.namespace_max_tokens)
            self.evict(max(over, 0) + max(short, 0), first=namespace if cap else None)
        return True

    def evictable_in(self, namespace: str) -> int:
        """Slots of the unlocked nodes of ``namespace``."""
        return sum(
            n.allocated for n in self._nodes.values() if n.namespace == namespace and not n.lock_ref
        )

    def order(self, node: EvictableNode) -> tuple[float, int]:
        """The node's place in the policy's order (lowest goes first)."""
        if self.policy == "gdsf":
            return node.priority, node.last_access
        if self.policy == "lfu":
            return node.hits, node.last_access
        return 0, node.last_access

    def reset(self) -> None:
        """After the table was cleared: GDSF's inflation starts over."""
        self.age = 0.0
