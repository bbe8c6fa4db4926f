"""Deleter: one order applied to chunk nodes, the prefix tree and the lower tiers; orders
from other servers (the shared store's log) applied to chunk nodes."""

from __future__ import annotations

from typing import Any

from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.deleter import Deleter
from sgl_pic.keys import ModelFingerprint
from sgl_pic.store.deletion import DeleteReport, Deletion, segment_contents
from tests.support.fakes import FakeAllocator

FP = ModelFingerprint(model_id="test-model", dtype="float32")
SEG = 4
X = list(range(100, 110))
Y = list(range(200, 208))


class Store:
    """Stands in for ``TieredStore``'s deletion methods (their contract: tests/store)."""

    def __init__(self, logged: tuple[Deletion, ...] = ()) -> None:
        self.deleted: list[Deletion] = []
        self.logged = logged

    def delete(self, d: Deletion) -> dict[str, DeleteReport]:
        self.deleted.append(d)
        return {"host": DeleteReport(2, 100), "disk": DeleteReport(1, 50)}

    def sync_deletions(self) -> tuple[Deletion, ...]:
        out, self.logged = self.logged, ()
        return out


class Tree:
    def __init__(self) -> None:
        self.evictions = 0

    def evict_prefix_tree(self) -> int:
        self.evictions += 1
        return 7


def table() -> ChunkNodeTable:
    t = ChunkNodeTable(FakeAllocator(64), FP, SEG, 64)
    assert t.insert(X, None, "a") and t.insert(Y, None, "a") and t.insert(X, None, "b")
    return t


def test_an_order_reaches_every_tier_and_the_prefix_tree(metrics: Any) -> None:
    nodes, store, tree = table(), Store(), Tree()
    before = metrics.deleted_records.labels(tier="device")._value.get()
    order = Deletion(namespaces=frozenset({"a"}), contents=segment_contents(X, SEG))
    report = Deleter(nodes, tree, store, metrics).execute(order)
    assert report == {
        "tiers": {
            "device": {"records": 3, "tokens": 10, "pending_tokens": 0},
            "host": {"records": 2, "bytes": 100},
            "disk": {"records": 1, "bytes": 50},
        },
        "prefix_tree_evicted_tokens": 7,
    }
    assert store.deleted == [order] and tree.evictions == 1
    assert nodes.match(X, "a") is None and nodes.match(Y, "a") and nodes.match(X, "b")
    assert metrics.deleted_records.labels(tier="device")._value.get() == before + 3


def test_orders_from_the_shared_log_reach_the_chunk_nodes(metrics: Any) -> None:
    nodes = table()
    store = Store((Deletion(namespaces=frozenset({"b"})),))
    deleter = Deleter(nodes, Tree(), store, metrics)
    assert deleter.sync() == 3
    assert nodes.match(X, "b") is None and nodes.match(X, "a") is not None
    assert deleter.sync() == 0  # nothing new
    assert Deleter(nodes).sync() == 0  # no lower tiers: nothing to sync
