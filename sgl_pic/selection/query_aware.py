"""Query-aware selection: recompute the reused tokens the fresh question attends to most.

Sources:

* ProphetKV (96-101% of full prefill at 20% recompute), A^3 and QCFuse select reused
  tokens by the question's attention to them, not by how far their KV drifted;
* EPIC: the first tokens of each chunk (the attention sink of its independent encoding)
  matter most.

Our diagnosis on SmolLM2 (``bench/results/diagnosis.md``) backs both: the first-token KL
follows what the question reads, not where the reused KV is most wrong (deviation x
attention beats deviation alone by 2x), and each chunk's first token keeps the sink keys
of its independent encoding, which pull the question's deep-layer attention away from the
real prefix.

The signal (``ctx.query_attention``, supplied by the executor) is the question's attention
to every prompt token at the first ``qa_layers`` layers, computed on the assembled
(reused, re-rotated) KV by pushing only the fresh tokens through those layers: the
question's queries are computed anyway, and early layers are nearly exact on reused KV
(layer 0 is exact), so the ranking costs a fraction of a forward of the question.
``question_attention`` is the one definition of that score; the oracle and the server's
probe both call it.

Candidates are the tokens whose reused KV is approximate (CacheBlend's
``reused_candidates``: chunk tokens not at position 0, outside the device prefix). The
budget is ceil(qa_ratio x candidates), but at least ``qa_min_tokens`` per candidate chunk
(DARIC's per-chunk token budget as a floor: on chunks of a few dozen tokens a fraction
leaves too little, see the gate's short prompts): first the ``qa_sink_tokens`` first
tokens of every candidate chunk, then the highest-attention candidates, ties to the lower
index.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from sgl_pic.layout import PromptLayout
from sgl_pic.selection.base import Selection, SelectionContext, SelectionPolicy, ceil_fraction
from sgl_pic.selection.cacheblend import reused_candidates
from sgl_pic.selection.registry import register_policy


@register_policy
class QueryAware(SelectionPolicy):
    """Per-chunk sinks, then the top ``qa_ratio`` of the reused tokens by the question's
    early-layer attention."""

    name = "query_aware"
    needs_query_attention = True

    def select(self, ctx: SelectionContext) -> Selection:
        if ctx.query_attention is None:
            raise ValueError(
                "query_aware needs ctx.query_attention (the question's early-layer attention "
                "to the prompt); this executor does not provide it"
            )
        candidates = reused_candidates(ctx)
        if candidates.numel() == 0:
            return Selection(torch.empty(0, dtype=torch.int64))
        chunks = chunk_sinks(ctx, 1).numel()
        floor = min(candidates.numel(), self.config.qa_min_tokens * chunks)
        count = max(ceil_fraction(self.config.qa_ratio, candidates.numel()), floor)
        sinks = chunk_sinks(ctx, self.config.qa_sink_tokens)[:count]
        rest = candidates[~torch.isin(candidates, sinks)]
        take = count - sinks.numel()
        if take <= 0 or rest.numel() == 0:
            return Selection(torch.sort(sinks).values)
        scores = ctx.query_attention().detach().to("cpu", torch.float64)
        if scores.shape != (ctx.layout.num_tokens,):
            raise ValueError(
                f"query_attention must have shape ({ctx.layout.num_tokens},), "
                f"got {tuple(scores.shape)}"
            )
        order = torch.sort(scores[rest], descending=True, stable=True).indices
        return Selection(torch.sort(torch.cat([sinks, rest[order[:take]]])).values)


def chunk_sinks(ctx: SelectionContext, per_chunk: int) -> torch.Tensor:
    """# [k] int64: the first ``per_chunk`` tokens of every candidate chunk (see the module
    doc), chunks in prompt order, so a budget smaller than all sinks keeps the earliest."""
    out: list[torch.Tensor] = []
    for span in ctx.layout.chunks:
        start = max(span.start, ctx.prefix_hit)
        if span.start == 0 or start > span.start:
            continue  # exact prefix KV, or partly device prefix (recomputed anyway)
        out.append(torch.arange(span.start, min(span.end, span.start + per_chunk)))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def query_positions(layout: PromptLayout, prefix_hit: int = 0) -> torch.Tensor:
    """# [q] int64 positions whose queries score the prompt: the fresh tokens after the last
    chunk (the question), or the last token when the prompt ends inside a chunk."""
    last_end = max((s.end for s in layout.chunks), default=0)
    fresh = torch.tensor(layout.fresh_indices(), dtype=torch.int64)
    tail = fresh[(fresh >= last_end) & (fresh >= prefix_hit)]
    if tail.numel() == 0:
        return torch.tensor([layout.num_tokens - 1], dtype=torch.int64)
    return tail


class KeyRows(Protocol):
    """Keys read on demand, # [num_keys, num_kv_heads, head_dim] (a tensor is one): a
    slice is the keys of those positions, e.g. gathered from a KV pool tile by tile."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def device(self) -> torch.device: ...

    def __getitem__(self, rows: slice) -> torch.Tensor: ...


def question_attention(
    q: torch.Tensor,  # [num_queries, num_heads, head_dim] post-RoPE queries
    k: torch.Tensor | KeyRows,  # [num_keys, num_kv_heads, head_dim] post-RoPE, key j at j
    q_pos: torch.Tensor,  # [num_queries] int64 positions of the queries
    scale: float | None = None,
    first_pos: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """# [num_keys] float32: softmax attention of each query head to each key (a query sees
    positions <= its own), summed over heads and queries. Sums, not means, so a tensor-
    parallel rank's partial over its own heads adds up to the whole.

    ``first_pos`` is ``q_pos``'s least value, known on the host: a caller that keeps
    ``q_pos`` on ``k``'s device passes it, so that neither that read nor a copy of
    ``q_pos`` waits for the device (a host ``q_pos`` is copied, blocking).

    ``tile``: most keys scored at once (None: all). With more keys than that, the float32
    logits are # [num_kv_heads, group * num_queries, tile] at most, not one row per key:
    a first pass over the tiles finds each row's softmax maximum and normaliser, a second
    sums the normalised weights (each tile's logits computed twice, the same up to float
    rounding as one softmax). With fewer, one softmax as ever, bit for bit."""
    nq, heads, dim = q.shape
    num_keys, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    # One batched matmul per KV head (GQA groups folded into rows): the probe runs this on
    # every probed layer of every request, inside the selection's share of TTFT.
    qq = (q.to(torch.float32) * scale).reshape(nq, kv_heads, group, dim)
    qq = qq.permute(1, 2, 0, 3).reshape(kv_heads, group * nq, dim)
    if first_pos is None and nq:
        first_pos = int(q_pos.min())
    # Only keys after the earliest query can be hidden from some query: mask that tail.
    first = first_pos + 1 if nq and first_pos is not None else num_keys
    row_pos = q_pos.to(k.device).repeat(group) if first < num_keys else None
    if tile is None or num_keys <= tile or nq == 0:
        logits = _masked_logits(qq, k, 0, num_keys, first, row_pos)  # [Hkv, g * nq, N]
        return torch.softmax(logits, dim=-1).sum(dim=(0, 1))
    # The first tile holds key 0, which every query sees: each row's maximum is finite
    # from there on, and keys hidden later weigh exp(-inf) = 0.
    most = total = torch.empty(0)
    for at in range(0, num_keys, tile):
        logits = _masked_logits(qq, k, at, min(at + tile, num_keys), first, row_pos)
        peak = logits.amax(dim=-1, keepdim=True)  # [Hkv, g * nq, 1]
        if at == 0:
            most, total = peak, torch.exp(logits - peak).sum(dim=-1, keepdim=True)
            continue
        new = torch.maximum(most, peak)
        total = total * torch.exp(most - new) + torch.exp(logits - new).sum(dim=-1, keepdim=True)
        most = new
    out = torch.empty(num_keys, dtype=torch.float32, device=qq.device)
    for at in range(0, num_keys, tile):
        end = min(at + tile, num_keys)
        logits = _masked_logits(qq, k, at, end, first, row_pos)
        out[at:end] = (torch.exp(logits - most) / total).sum(dim=(0, 1))
    return out


def _masked_logits(
    qq: torch.Tensor,  # [num_kv_heads, group * num_queries, head_dim] scaled float32 queries
    k: torch.Tensor | KeyRows,  # [num_keys, num_kv_heads, head_dim]
    start: int,
    end: int,
    first: int,  # keys from here on may be hidden from some query
    row_pos: torch.Tensor | None,  # [group * num_queries] each row's query position
) -> torch.Tensor:
    """# [num_kv_heads, group * num_queries, end - start] float32 logits of keys
    [start, end), -inf where a key lies past its row's query."""
    logits = torch.bmm(qq, k[start:end].to(torch.float32).permute(1, 2, 0))
    if row_pos is not None and end > first:
        at = max(start, first)
        tail = torch.arange(at, end, device=qq.device)
        hidden = tail[None, :] > row_pos[:, None]
        logits[:, :, at - start :].masked_fill_(hidden, float("-inf"))
    return logits
