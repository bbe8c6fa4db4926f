"""The executor applies other servers' deletion orders (the shared store's log) to its
chunk nodes before a batch's lookups, on the host-sync harness's executor."""

from __future__ import annotations

import pytest

from sgl_pic.engine.deleter import Deleter
from sgl_pic.store.deletion import Deletion, segment_contents
from tests.engine.test_host_syncs import SEGMENT, Server, chunk, prompts

pytestmark = pytest.mark.sglang


class Log:
    """Stands in for ``TieredStore.sync_deletions``: hands out what was logged once."""

    def __init__(self) -> None:
        self.pending: list[Deletion] = []
        self.reads = 0

    def sync_deletions(self) -> tuple[Deletion, ...]:
        self.reads += 1
        out, self.pending = tuple(self.pending), []
        return out


def same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def test_orders_from_the_log_apply_before_the_lookups_of_each_batch() -> None:
    server = Server("full_reuse")
    log = Log()
    nodes = server.executor.nodes
    server.executor.sync_deletions = Deleter(nodes, store=log).sync
    server.run(prompts([[1, 2]]))  # both chunks computed and stored
    first = nodes.match(chunk(1))
    assert first is not None and log.reads == 1
    server.run(prompts([[1, 2]]))  # nothing logged: both hit the same nodes
    again = nodes.match(chunk(1))
    assert again is not None and same(again.nodes, first.nodes) and log.reads == 2
    # Another server deletes chunk 1: this batch must not hit it, but compute it afresh.
    log.pending.append(Deletion(contents=segment_contents(chunk(1), SEGMENT)))
    kept = nodes.match(chunk(2))
    server.run(prompts([[1, 2]]))
    fresh = nodes.match(chunk(1))
    assert fresh is not None and not any(n is o for n in fresh.nodes for o in first.nodes)
    still = nodes.match(chunk(2))
    assert kept is not None and still is not None and same(still.nodes, kept.nodes)
