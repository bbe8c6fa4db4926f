"""Reference policies: recompute everything, nothing, or EPIC's chunk-initial tokens.

They bound the quality/latency trade-off from both ends (full recompute is exact,
full reuse is the fastest) and give the prior-driven baseline DARIC improves on.
"""

from __future__ import annotations

import torch

from sgl_pic.selection.base import Selection, SelectionContext, SelectionPolicy, as_selection
from sgl_pic.selection.registry import register_policy


@register_policy
class FullRecompute(SelectionPolicy):
    """Every token: the exact prefill, the quality upper bound."""

    name = "full_recompute"

    def select(self, ctx: SelectionContext) -> Selection:
        return Selection(torch.arange(ctx.layout.num_tokens, dtype=torch.int64))


@register_policy
class FullReuse(SelectionPolicy):
    """No token. Executors still compute fresh tokens and the last token (``finalize``),
    since neither has cached KV to reuse."""

    name = "full_reuse"

    def select(self, ctx: SelectionContext) -> Selection:
        return Selection(torch.empty(0, dtype=torch.int64))


@register_policy
class Epic(SelectionPolicy):
    """EPIC: the first ``epic_k`` tokens of every chunk (its attention sink), except a
    chunk that is the first segment of the prompt: it sits at position 0, so its
    independently encoded KV already equals the prefix KV."""

    name = "epic"

    def select(self, ctx: SelectionContext) -> Selection:
        k = self.config.epic_k
        indices: list[int] = []
        for span in ctx.layout.chunks:
            if span.start == 0:
                continue
            indices.extend(range(span.start, span.start + min(k, span.length)))
        return as_selection(indices)
