"""What a multi-turn session's server counters should show, computed offline."""

from __future__ import annotations

import torch

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout

CONTIG = 'sgl_pic_chunk_hits_total{kind="contiguous"}'
DISJOINT = 'sgl_pic_chunk_hits_total{kind="disjoint"}'
MISSES = "sgl_pic_chunk_misses_total"
PREFIX = "sgl_pic_chunk_device_prefix_total"
SESSION_KEYS = (
    CONTIG,
    DISJOINT,
    MISSES,
    PREFIX,
    "sgl_pic_requests_total",
    "sgl_pic_chunk_lookups_total",
    "sgl_pic_recomputed_tokens_total",
    "sgl_pic_new_tokens_total",
    "sgl_pic_reused_tokens_total",
    "sgl_pic_failures_total",
    "sgl_pic_fallbacks_total",
)


def offline_recompute(layout: PromptLayout, prefix: int, config: PicConfig) -> torch.Tensor:
    """The positions the executor recomputes for ``layout`` with device prefix ``prefix``
    (# [k] int64): the policy's selection, finalized (fresh and last tokens added, the
    prefix dropped). A chunk the prefix ends inside is reused past it like any chunk (from
    a stored copy, or encoded whole when missed: the test servers store every miss,
    ``--pic-admission always``), so nothing of it is forced."""
    from sgl_pic.selection import SelectionContext, finalize, make_policy

    ctx = SelectionContext(layout, rankings=None, deviation=None, prefix_hit=prefix)
    sel = finalize(make_policy(config).select(ctx), layout, prefix).indices
    return sel[sel >= prefix]
