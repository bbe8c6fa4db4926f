"""The token-selection interface shared by every policy.

A policy answers one question: which token positions of an assembled prompt get
their KV recomputed. It never touches KV itself; the executor does.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout


class SelectionContext(NamedTuple):
    """What a policy may look at for one request.

    layout:        chunk spans of the assembled prompt.
    rankings:      per chunk of ``layout.chunks``, the offline CacheTune ranking stored
                   with the chunk (# [chunk_len] float, higher = recompute first), or
                   None where the chunk has none.
    deviation:     CacheBlend's online signal: a callable that recomputes the first
                   layer for all reused tokens and returns their K/V deviation
                   (# [num_tokens] float; fresh tokens score 0). Costly: call once,
                   and only if the policy needs it. None when the executor cannot.
    prefix_hit:    tokens [0, prefix_hit) are resident as exact device prefix KV and
                   are never recomputed (hit-aware refinement).
    query_attention: the query-aware signal: a callable that pushes the fresh tokens
                   through the first ``qa_layers`` layers over the assembled KV and
                   returns the question's attention to every token (# [num_tokens]
                   float, ``query_aware.question_attention`` summed over those layers).
                   Costly like ``deviation``: call once, only if needed; None when the
                   executor cannot.
    """

    layout: PromptLayout
    rankings: tuple[torch.Tensor | None, ...] | None = None
    deviation: Callable[[], torch.Tensor] | None = None
    prefix_hit: int = 0
    query_attention: Callable[[], torch.Tensor] | None = None


class Selection(NamedTuple):
    """Sorted, unique global token indices to recompute (# [k] int64)."""

    indices: torch.Tensor


class SelectionPolicy(ABC):
    """Chooses the tokens to recompute.

    ``select`` is pure: it reads the context and returns a new Selection; it changes
    nothing. Its result may include any tokens; ``finalize`` (applied by executors)
    adds fresh tokens and the last token and drops the device prefix.
    """

    name: ClassVar[str]
    needs_ranking: ClassVar[bool] = False
    needs_deviation: ClassVar[bool] = False
    needs_query_attention: ClassVar[bool] = False

    def __init__(self, config: PicConfig) -> None:
        self.config = config

    @abstractmethod
    def select(self, ctx: SelectionContext) -> Selection:
        """Indices to recompute for this request; see the class docstring."""


def as_selection(indices: torch.Tensor | list[int]) -> Selection:
    """Sorted unique int64 indices."""
    t = torch.as_tensor(indices, dtype=torch.int64).flatten()
    return Selection(torch.unique(t))


def ceil_fraction(ratio: float, n: int) -> int:
    """ceil(ratio * n), at least 1 of a non-empty set, without float noise turning
    0.15 * 20 = 3.0000000000000004 into 4."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(ratio * n - 1e-9)))


def finalize(selection: Selection, layout: PromptLayout, prefix_hit: int = 0) -> Selection:
    """What an executor computes: the policy's choice plus every fresh token (they
    have no cached KV) and the last token (its logits are the answer), minus tokens
    inside the exact device prefix."""
    fresh = torch.tensor(layout.fresh_indices(), dtype=torch.int64)
    last = torch.tensor([layout.num_tokens - 1], dtype=torch.int64)
    idx = torch.unique(torch.cat([selection.indices.to(torch.int64), fresh, last]))
    if idx.numel() and (idx.min() < 0 or idx.max() >= layout.num_tokens):
        raise ValueError(f"selection has indices outside [0, {layout.num_tokens})")
    keep = (idx >= prefix_hit) | (idx == layout.num_tokens - 1)
    return Selection(idx[keep])
