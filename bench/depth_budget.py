"""Budgets that follow depth (CacheBlend's gradual filtering), a correction studied by
``bench/fidelity.py --depth`` beside the fixed-ratio default (issue #46).

The default recomputes one token set at every layer. Here the set may differ by layer, at
the same compute: layer ``l`` recomputes ``counts[l]`` of the chunk tokens, the fresh
tokens and the last token, and the mean of ``counts`` over layers is the budget.

The sets are nested and shrink with depth (S_0 ⊇ S_1 ⊇ ...). A token's layer-``l`` K/V
can only be recomputed from its layer-``l`` input, which exists for a token computed at
layer ``l - 1``; a token first chosen at a deep layer would need every layer below it run
too, which is the same token in a larger fixed set. So a budget that grows with depth (where
the diagnosis finds most of the deviation) is not a schedule of one pass; this module
measures the shrinking ones, each with one of two per-layer signals for which rows carry
on:

- ``deviation``: CacheBlend's, the L2 distance of a row's recomputed layer-``l`` K/V from
  the reused K/V it replaces;
- ``attention``: the question's attention to the row at layer ``l`` (the question is
  recomputed at every layer, so the signal is exact for that layer's K).

S_0 is the default policy's selection (query_aware, its probe) at the schedule's first
fraction. Plain torch over the oracle's primitives: a reference, not a serving path.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.oracle import Oracle
from sgl_pic.oracle.forward import (
    KVCache,
    attention,
    logits_of,
    mlp,
    project_qkv,
    rms_norm,
)
from sgl_pic.oracle.oracle import ChunkKV
from sgl_pic.rope import apply_rope
from sgl_pic.selection import Selection, SelectionContext, finalize, make_policy
from sgl_pic.selection.query_aware import query_positions, question_attention

SIGNALS = ("deviation", "attention")


class DepthSchedule(NamedTuple):
    """Fractions of the chunk tokens recomputed at the first and the last layer, linear in
    between (non-increasing: the sets are nested), and the signal that picks which rows go
    on at each layer."""

    first: float
    last: float
    signal: str

    @property
    def label(self) -> str:
        return f"query_aware depth {self.first:.0%}->{self.last:.0%} by {self.signal}"

    def counts(self, chosen: int, num_layers: int) -> list[int]:
        """Chunk rows computed at each layer, when layer 0 computes ``chosen`` of them."""
        if num_layers == 1:
            return [chosen]
        shrink = self.last / self.first if self.first > 0 else 1.0
        return [
            round(chosen * (1.0 + (shrink - 1.0) * li / (num_layers - 1)))
            for li in range(num_layers)
        ]


def check_schedule(s: DepthSchedule) -> None:
    if not 0.0 <= s.last <= s.first <= 1.0:
        raise ValueError(f"a depth schedule needs 0 <= last <= first <= 1, got {s}")
    if s.signal not in SIGNALS:
        raise ValueError(f"unknown depth signal {s.signal!r}; known: {', '.join(SIGNALS)}")


class DepthResult(NamedTuple):
    kv: KVCache  # [num_layers, N, num_kv_heads, head_dim] each: the request's KV
    logits: torch.Tensor  # [vocab] float32, last position
    computed: Selection  # layer 0's set
    chunk_rows: list[int]  # chunk rows computed at each layer


@torch.inference_mode()
def gradual_recompute(
    oracle: Oracle,
    token_ids: torch.Tensor,  # [N]
    layout: PromptLayout,
    assembled: KVCache,  # [num_layers, N, num_kv_heads, head_dim] each; not modified
    first: Selection,  # layer 0's set (finalized: fresh tokens and the last one in it)
    counts: list[int],  # chunk rows kept at each layer, non-increasing
    signal: str,
) -> DepthResult:
    """Selective recomputation of nested, shrinking per-layer sets on a copy of
    ``assembled``: at each layer the fresh rows and the last row go on, and of the chunk
    rows the ``counts[l]`` with the highest ``signal`` of layer ``l - 1``. With ``counts``
    constant at the chunk rows of ``first`` it is ``Oracle.recompute`` of ``first``."""
    w = oracle.w
    n = token_ids.numel()
    if len(counts) != w.num_layers or any(b > a for a, b in itertools.pairwise(counts)):
        raise ValueError("counts must give each layer one count, non-increasing")
    idx = first.indices.to(torch.int64)
    if idx.numel() == 0 or int(idx[-1]) != n - 1:
        raise ValueError("the first set must include the last token (its logits)")
    in_chunk = torch.zeros(n, dtype=torch.bool)
    for span in layout.chunks:
        in_chunk[span.start : span.end] = True
    queries = query_positions(layout)
    kv = assembled.clone()
    slot_pos = torch.arange(n)
    h = F.embedding(token_ids[idx], w.embed)
    score: torch.Tensor | None = None  # [len(idx)] the last layer's signal per row
    rows_per_layer: list[int] = []
    for li, layer in enumerate(w.layers):
        chunk_rows = in_chunk[idx]
        if score is not None and int(chunk_rows.sum()) > counts[li]:
            ranked = torch.where(chunk_rows, score, torch.full_like(score, -torch.inf))
            keep = ~chunk_rows
            keep[torch.topk(ranked, counts[li]).indices] = True
            idx, h = idx[keep], h[keep]
            chunk_rows = chunk_rows[keep]
        rows_per_layer.append(int(chunk_rows.sum()))
        q, k, v = project_qkv(w, layer, h)
        q = apply_rope(q, idx, w.inv_freq, scale=w.rope_scale)
        k = apply_rope(k, idx, w.inv_freq, scale=w.rope_scale)
        if signal == "deviation" and li > 0:
            # Layer 0's K/V depend on the token alone: reused ones deviate by rounding only.
            score = (k - assembled.k[li, idx].to(k.dtype)).flatten(1).norm(dim=1) + (
                v - assembled.v[li, idx].to(v.dtype)
            ).flatten(1).norm(dim=1)
        kv.k[li, idx] = k.to(kv.k.dtype)
        kv.v[li, idx] = v.to(kv.v.dtype)
        if signal == "attention":
            rows = torch.searchsorted(idx, queries)
            score = question_attention(q[rows], kv.k[li], queries)[idx]
        attn = attention(w, q, kv.k[li], kv.v[li], idx, slot_pos)
        h = h + F.linear(attn, layer.o_proj, layer.o_bias)
        h = h + mlp(layer, rms_norm(h, layer.post_norm, w.rms_eps))
    hidden = rms_norm(h[-1:], w.final_norm, w.rms_eps)
    return DepthResult(kv, logits_of(w, hidden)[0], first, rows_per_layer)


def timed_depth_reuse(
    oracle: Oracle,
    token_ids: torch.Tensor,  # [N]
    layout: PromptLayout,
    chunks: list[ChunkKV],
    config: PicConfig,  # the default policy's settings (query_aware's probe depth)
    schedule: DepthSchedule,
) -> tuple[DepthResult, float, float]:
    """Assembly, layer 0's selection (query_aware at ``schedule.first``) and the gradual
    recomputation: the result, its seconds and the selection's seconds."""
    check_schedule(schedule)
    t0 = time.perf_counter()
    assembled = oracle.assemble(token_ids, layout, chunks)
    policy = make_policy(config.with_overrides(policy="query_aware", qa_ratio=schedule.first))
    ctx = SelectionContext(
        layout=layout,
        rankings=tuple(c.ranking for c in chunks),
        query_attention=lambda: oracle.query_attention(
            token_ids, layout, assembled, policy.config.qa_layers
        ),
    )
    t1 = time.perf_counter()
    first = finalize(policy.select(ctx), layout)
    t2 = time.perf_counter()
    in_chunks = sum(
        int(((first.indices >= s.start) & (first.indices < s.end)).sum()) for s in layout.chunks
    )
    counts = schedule.counts(in_chunks, oracle.w.num_layers)
    res = gradual_recompute(oracle, token_ids, layout, assembled, first, counts, schedule.signal)
    return res, time.perf_counter() - t0, t2 - t1
