"""Promotion loads run on the promoter's worker, confined to it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_pic.integration.promoter import Promoter


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
        self.stored: dict[tuple[int, ...], torch.Tensor] = {}

    def match(self, chunk_ids: tuple[int, ...]) -> torch.Tensor | None:
        return self.stored.get(chunk_ids)


def test_load_runs_on_a_confined_worker_and_fills_the_nodes() -> None:
    nodes = Nodes()
    seen: list[int] = []

    def load_full(_hit: object, chunk_ids: tuple[int, ...]) -> torch.Tensor:
        # The worker's torch ops must not bring up an OpenMP team beside the forward's.
        seen.append(torch.get_num_threads())
        return torch.zeros(2, 2, len(chunk_ids), 1, 4)

    def store(chunk_ids: tuple[int, ...], kv: torch.Tensor, _ranking: object) -> None:
        nodes.stored[chunk_ids] = kv

    metrics = SimpleNamespace(promotions=Count(), queue_drops=Count())
    promoter = Promoter(nodes, load_full, store, metrics)  # type: ignore[arg-type]
    ids = (5, 6, 7)
    promoter.submit(object(), ids, None)
    assert promoter.finish(ids, timeout_s=30)
    promoter.close()
    assert seen == [1]
    assert ids in nodes.stored and metrics.promotions.n == 1
