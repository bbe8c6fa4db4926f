"""Helpers for the store tests: small random records with valid keys, and disk writes
held or slowed."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import NamedTuple

import pytest
import torch

from sgl_pic.keys import ModelFingerprint
from sgl_pic.store.base import ChunkKV
from sgl_pic.store.disk import store as disk_mod

MODEL = ModelFingerprint(model_id="test-model", dtype="float32", pre_rope=True).digest()
OTHER_MODEL = ModelFingerprint(model_id="other-model", dtype="float32", pre_rope=True).digest()


def make_record(
    seed: int = 0,
    num_layers: int = 3,
    num_tokens: int = 40,
    heads: int = 3,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    model: str = MODEL,
    ranking: bool = True,
    layer_start: int = 0,
) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_tokens, heads, head_dim)
    tokens = torch.randint(0, 50000, (num_tokens,), generator=g).tolist()
    key = hashlib.sha256(f"rec:{seed}:{num_tokens}:{model}".encode()).hexdigest()
    return ChunkKV(
        key=key,
        model_digest=model,
        token_ids=tokens,
        k=torch.randn(shape, generator=g).to(dtype),
        v=torch.randn(shape, generator=g).to(dtype),
        ranking=torch.rand(num_tokens, generator=g) if ranking else None,
        layer_start=layer_start,
    )


def same_record(a: ChunkKV, b: ChunkKV) -> bool:
    """Bit-exact equality of everything a record holds."""
    rank_eq = (a.ranking is None and b.ranking is None) or (
        a.ranking is not None and b.ranking is not None and torch.equal(a.ranking, b.ranking)
    )
    return (
        a.key == b.key
        and a.model_digest == b.model_digest
        and a.token_ids == b.token_ids
        and a.layer_start == b.layer_start
        and a.k.dtype == b.k.dtype
        and torch.equal(a.k.contiguous().view(torch.uint8), b.k.contiguous().view(torch.uint8))
        and torch.equal(a.v.contiguous().view(torch.uint8), b.v.contiguous().view(torch.uint8))
        and rank_eq
    )


class HeldWrites(NamedTuple):
    """started: set by each disk write as it begins. release: what each waits for."""

    started: threading.Event
    release: threading.Event


def hold_disk_writes(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.0) -> HeldWrites:
    """Every disk write (``disk.write_record``) sets ``started``, waits for ``release``
    (30 s at most: a hang guard), takes ``seconds`` more, then writes. Tests of the
    background queues hold a write this way, so that what they count does not depend on
    when the writer thread runs; set ``release`` at once for slow writes alone."""
    real = disk_mod.write_record
    held = HeldWrites(threading.Event(), threading.Event())

    def write(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        held.started.set()
        held.release.wait(30)
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(disk_mod, "write_record", write)
    return held
