"""CacheBlend: recompute the reused tokens whose first-layer KV deviates most.

CacheBlend recomputes a fixed ratio of the *reused* tokens, those with the highest KV
deviation (its HKVD tokens), found by recomputing one check layer (the first, as in
its released implementation) for the whole prompt. Candidates here are the tokens
whose cached KV is only an approximation of the prefix KV:

* tokens of chunks, not fresh tokens (those have no cached KV and are computed anyway);
* not in the first segment when it is a chunk: it starts at position 0, so its
  independently encoded KV is the prefix KV (deviation 0 up to round-off). A chunk
  that follows fresh text is a candidate like any other;
* not in the exact device prefix [0, prefix_hit), whose KV is exact as well.

The budget is ceil(cacheblend_ratio * number of candidates), ties to the lower index.
"""

from __future__ import annotations

import torch

from sgl_pic.selection.base import Selection, SelectionContext, SelectionPolicy, ceil_fraction
from sgl_pic.selection.registry import register_policy


@register_policy
class CacheBlend(SelectionPolicy):
    """Top ``cacheblend_ratio`` of the approximately reused tokens by online deviation."""

    name = "cacheblend"
    needs_deviation = True

    def select(self, ctx: SelectionContext) -> Selection:
        if ctx.deviation is None:
            raise ValueError(
                "cacheblend needs ctx.deviation (the first-layer K/V deviation of the "
                "prompt); this executor does not provide it"
            )
        layout = ctx.layout
        candidates = reused_candidates(ctx)
        if candidates.numel() == 0:
            return Selection(torch.empty(0, dtype=torch.int64))
        deviation = ctx.deviation().detach().cpu()
        if deviation.shape != (layout.num_tokens,):
            raise ValueError(
                f"deviation must have shape ({layout.num_tokens},), got {tuple(deviation.shape)}"
            )
        count = ceil_fraction(self.config.cacheblend_ratio, candidates.numel())
        # A stable descending sort of candidates in index order breaks ties by index.
        order = torch.sort(deviation[candidates], descending=True, stable=True).indices
        return Selection(torch.sort(candidates[order[:count]]).values)


def reused_candidates(ctx: SelectionContext) -> torch.Tensor:
    """Sorted global indices of CacheBlend's candidate tokens (# [k] int64); see the
    module docstring."""
    layout = ctx.layout
    lo = ctx.prefix_hit
    indices: list[torch.Tensor] = []
    for span in layout.chunks:
        if span.start == 0:
            continue  # the first segment: exact prefix KV
        start = max(span.start, lo)
        if start < span.end:
            indices.append(torch.arange(start, span.end, dtype=torch.int64))
    return torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64)
