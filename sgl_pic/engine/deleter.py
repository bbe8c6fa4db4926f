"""Deletion on the scheduler: one order applied to every place this process keeps KV.

- chunk nodes (``ChunkNodeTable.delete``): matching nodes leave the index at once; a node
  a running request holds frees its slots when that request lets go;
- SGLang's prefix tree: chunked requests leave their prompt's KV, chunks included, in our
  namespaces of the tree (``gate.namespace``), keyed by position, not by chunk. SGLang
  0.5.23's tree core offers no walk by namespace and cannot evict a node a running
  request holds, so each deletion bumps ``generation``, which the gate puts in the tree
  namespace of every chunked request admitted after it: no later request can match a
  node made before (held, or inserted when its request finishes). Every unlocked node of
  the tree is also evicted at once through SGLang's own eviction (the path memory pressure
  takes, which keeps its accounting), so the old nodes' slots come back now rather than
  when LRU reaches them. Every tenant's chunked requests lose their prefix hits once;
- the host, disk and shared tiers (``TieredStore.delete``), which also drop queued work
  carrying deleted records.

``sync`` applies the orders other servers wrote to a shared store's log (returned by
``TieredStore.sync_deletions``, which applied them to host and disk) to the chunk nodes;
the executor calls it before each batch's lookups.

Runs on SGLang's scheduler thread (the gate and the executor), every tensor-parallel rank
alike, so each rank's state changes the same way.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.store.deletion import Deletion

logger = logging.getLogger(__name__)


class PrefixTree(Protocol):
    """The part of ``radix_cache.ChunkRadixCache`` a deletion uses."""

    def evict_prefix_tree(self) -> int:
        """Evicts every unlocked node of SGLang's own tree; the tokens freed."""
        ...


class Deleter:
    """nodes: this scheduler's chunk nodes. tree: its prefix tree (None: nothing to evict
    there). store: the ``TieredStore`` under them (None: no lower tiers). metrics: where
    deletions are counted (``PicMetrics.deletions``)."""

    def __init__(
        self,
        nodes: ChunkNodeTable,
        tree: PrefixTree | None = None,
        store: Any = None,
        metrics: Any = None,
    ) -> None:
        self.nodes = nodes
        self.tree = tree
        self.store = store
        self.metrics = metrics
        # Deletions applied so far: the gate names chunked requests' tree namespaces by it.
        self.generation = 0

    def execute(self, deletion: Deletion) -> dict[str, Any]:
        """Applies ``deletion`` everywhere; the report (JSON-ready): per tier the records
        removed and their size, and the prefix-tree tokens evicted."""
        self.generation += 1
        dev = self.nodes.delete(deletion)
        tiers: dict[str, dict[str, int]] = {
            "device": {
                "records": dev.records,
                "tokens": dev.tokens,
                "pending_tokens": dev.pending_tokens,
            }
        }
        if self.store is not None:
            for tier, rep in self.store.delete(deletion).items():
                tiers[tier] = {"records": int(rep.records), "bytes": int(rep.nbytes)}
        evicted = self.tree.evict_prefix_tree() if self.tree is not None else 0
        if self.metrics is not None:
            for tier, rep in tiers.items():
                self.metrics.deleted_records.labels(tier=tier).inc(rep["records"])
        logger.info("sgl_pic: deletion executed: %s; prefix tree evicted %d", tiers, evicted)
        return {"tiers": tiers, "prefix_tree_evicted_tokens": evicted}

    def sync(self) -> int:
        """Applies to the chunk nodes the orders other servers sharing the store issued
        since the last call; the nodes removed."""
        if self.store is None:
            return 0
        removed = 0
        # ``generation`` stays: the log is read per rank, at times of its own, and the
        # ranks' prefix trees must name requests alike.
        for deletion in self.store.sync_deletions():
            removed += self.nodes.delete(deletion).records
        if removed and self.metrics is not None:
            self.metrics.deleted_records.labels(tier="device").inc(removed)
        return removed
