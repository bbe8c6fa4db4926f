"""Promotion loads run on the promoter's worker, confined to it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_pic.engine.promoter import Promoter


class Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1

    def labels(self, **_: str) -> Count:
        return self


class Nodes:
    capacity_tokens = 64
    generation = 0

    def __init__(self) -> None:
        self.stored: dict[tuple[str, str, tuple[int, ...]], torch.Tensor] = {}

    def match(
        self, chunk_ids: tuple[int, ...], namespace: str = "", context: str = ""
    ) -> torch.Tensor | None:
        return self.stored.get((namespace, context, chunk_ids))

    def store(
        self,
        chunk_ids: tuple[int, ...],
        kv: torch.Tensor,
        _ranking: object,
        ns: str,
        context: str,
        _contents: tuple[str, ...],
    ) -> None:
        """The promoter's ``store``: fills the node of (namespace, context, chunk)."""
        self.stored[(ns, context, chunk_ids)] = kv


def test_load_runs_on_a_confined_worker_and_fills_the_nodes() -> None:
    nodes = Nodes()
    seen: list[int] = []

    def load_full(_hit: object, chunk_ids: tuple[int, ...]) -> torch.Tensor:
        # The worker's torch ops must not bring up an OpenMP team beside the forward's.
        seen.append(torch.get_num_threads())
        return torch.zeros(2, 2, len(chunk_ids), 1, 4)

    metrics = SimpleNamespace(promotions=Count(), queue_drops=Count())
    promoter = Promoter(nodes, load_full, nodes.store, metrics)  # type: ignore[arg-type]
    ids = (5, 6, 7)
    promoter.submit(object(), ids, None)
    assert promoter.finish(("", "", ids), timeout_s=30)
    promoter.close()
    assert seen == [1]
    assert ("", "", ids) in nodes.stored and metrics.promotions.n == 1


def test_a_promotion_fills_only_its_own_namespace() -> None:
    """A chunk tenant A's request promoted is a node of A's namespace; the same tokens of
    tenant B are promoted on their own, into B's."""
    nodes = Nodes()

    metrics = SimpleNamespace(promotions=Count(), queue_drops=Count())
    promoter = Promoter(
        nodes,
        lambda _h, ids: torch.zeros(1, 2, len(ids), 1, 1),
        nodes.store,
        metrics,  # type: ignore[arg-type]
    )
    ids = (1, 2, 3)
    promoter.submit(object(), ids, None, "tenant-a")
    assert ("tenant-a", "", ids) in promoter and ("tenant-b", "", ids) not in promoter
    assert promoter.finish(("tenant-a", "", ids), timeout_s=30)
    assert set(nodes.stored) == {("tenant-a", "", ids)}
    promoter.submit(object(), ids, None, "tenant-b")  # not held in B's namespace: loads
    assert promoter.finish(("tenant-b", "", ids), timeout_s=30)
    # Encoded after other tokens, the same chunk of A is another promotion and node.
    promoter.submit(object(), ids, None, "tenant-a", "c" * 64)
    assert promoter.finish(("tenant-a", "c" * 64, ids), timeout_s=30)
    promoter.close()
    assert set(nodes.stored) == {
        ("tenant-a", "", ids),
        ("tenant-b", "", ids),
        ("tenant-a", "c" * 64, ids),
    }
