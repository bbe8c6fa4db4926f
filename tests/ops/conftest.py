"""Fresh random KV data for the ops tests (never zeros: a copy of zeros proves nothing)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
import torch

RandKV = Callable[..., torch.Tensor]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    # Seeded per test so a failure reproduces, different across tests.
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.fixture
def rand_kv(gen: torch.Generator) -> RandKV:
    """rand_kv(*shape, dtype=, device=) -> normal values, no exact zeros."""

    def make(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, dtype=torch.float32)
        x = torch.where(x == 0, torch.ones_like(x), x)
        return x.to(dtype=dtype, device=device)

    return make


@pytest.fixture
def distinct(gen: torch.Generator) -> Callable[[int, int], torch.Tensor]:
    """distinct(n, bound) -> # [n] int64, distinct values in [0, bound), shuffled."""

    def make(n: int, bound: int) -> torch.Tensor:
        return torch.randperm(bound, generator=gen)[:n]

    return make
