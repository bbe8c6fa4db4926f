"""The reference oracle: exact, readable chunk reuse over a model's own weights.

It is the judge of every faster path (SGLang integration, kernels, tiers), not the
product. Every path is a call of ``forward_tokens`` with a different buffer and token
set, so full recompute (all tokens selected) equals full prefill exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from sgl_pic.layout import PromptLayout
from sgl_pic.oracle.forward import (
    KVCache,
    decode_step,
    empty_kv,
    forward_tokens,
    layer_rope,
    logits_of,
    project_qkv,
)
from sgl_pic.oracle.model_weights import ModelWeights
from sgl_pic.oracle.weights import load_hf_model, weights_from_hf
from sgl_pic.rope import rerotate
from sgl_pic.selection.base import (
    Selection,
    SelectionContext,
    SelectionPolicy,
    finalize,
)
from sgl_pic.selection.query_aware import query_positions, question_attention


class FullPrefill(NamedTuple):
    kv: KVCache  # [num_layers, num_tokens, num_kv_heads, head_dim] each
    logits: torch.Tensor  # [vocab] float32, last position


class ChunkKV(NamedTuple):
    """KV of one chunk encoded on its own (optionally after a shared prefix).

    Immutable by convention: assembly copies it; nothing writes into it."""

    token_ids: torch.Tensor  # [n]
    kv: KVCache  # keys post-RoPE at positions base_position .. base_position + n - 1
    pre_rope_k: torch.Tensor  # [num_layers, n, num_kv_heads, head_dim]
    base_position: int
    ranking: torch.Tensor | None  # [n] CacheTune score, higher = recompute first


class ReuseResult(NamedTuple):
    kv: KVCache  # the request's KV after recomputation
    logits: torch.Tensor  # [vocab] float32, last position
    computed: Selection  # token indices actually pushed through the model


class Oracle:
    """Plain-torch reference over a supported model's weights (``weights_from_hf``)."""

    def __init__(self, weights: ModelWeights, kv_dtype: torch.dtype = torch.float32) -> None:
        self.w = weights
        self.kv_dtype = kv_dtype

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Oracle:
        return cls(weights_from_hf(load_hf_model(path)))

    # -- exact references -------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor) -> FullPrefill:  # token_ids: [N]
        """Ordinary causal prefill of the whole prompt."""
        n = token_ids.numel()
        kv = empty_kv(self.w, n, self.kv_dtype)
        pos = torch.arange(n)
        out = forward_tokens(self.w, token_ids, pos, pos, kv, pos)
        return FullPrefill(kv, logits_of(self.w, out.hidden[-1:])[0])

    @torch.inference_mode()
    def encode_chunk(
        self,
        token_ids: torch.Tensor,  # [n]
        prefix: KVCache | None = None,
        ranker: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        start_position: int = 0,
    ) -> ChunkKV:
        """Independent KV of one chunk, from ``start_position`` (0 by default; any
        other value is for testing rotation) or right after ``prefix``.

        ranker(pre_rope_k, v) -> # [n] scores is run once here and stored with the
        chunk (CacheTune's offline ranking)."""
        if prefix is not None and start_position:
            raise ValueError("start_position and prefix are exclusive")
        p = start_position if prefix is None else prefix.num_tokens
        n = token_ids.numel()
        pos = torch.arange(p, p + n)
        if prefix is None:
            kv = empty_kv(self.w, n, self.kv_dtype)
            slots, slot_pos = torch.arange(n), pos
        else:
            kv = empty_kv(self.w, p + n, self.kv_dtype)
            kv.k[:, :p] = prefix.k
            kv.v[:, :p] = prefix.v
            slots, slot_pos = pos, torch.arange(p + n)
        out = forward_tokens(self.w, token_ids, pos, slots, kv, slot_pos, keep_pre_rope=True)
        own = KVCache(kv.k[:, slots].clone(), kv.v[:, slots].clone())
        ranking = None if ranker is None else ranker(out.pre_rope_k, own.v)
        return ChunkKV(token_ids.clone(), own, out.pre_rope_k, p, ranking)

    # -- reuse ------------------------------------------------------------------

    def assemble(
        self,
        token_ids: torch.Tensor,  # [N] the request's prompt
        layout: PromptLayout,
        chunks: Sequence[ChunkKV],
        deferred_rope: bool = False,
    ) -> KVCache:
        """The request's own KV buffer: each chunk's KV placed at its span, keys moved
        to their new positions (re-rotation of post-RoPE keys, or RoPE applied to
        stored pre-RoPE keys when ``deferred_rope``), each layer's with its own RoPE
        table. Fresh slots are zero; they must be computed. Raises if a chunk's tokens
        differ from the prompt's."""
        if len(chunks) != len(layout.chunks):
            raise ValueError(f"{len(chunks)} chunk KVs for {len(layout.chunks)} chunk spans")
        if token_ids.numel() != layout.num_tokens:
            raise ValueError(f"{token_ids.numel()} tokens for a layout of {layout.num_tokens}")
        kv = empty_kv(self.w, layout.num_tokens, self.kv_dtype)
        for i, (span, chunk) in enumerate(zip(layout.chunks, chunks, strict=True)):
            if not torch.equal(chunk.token_ids, token_ids[span.start : span.end]):
                raise ValueError(f"chunk {i}'s cached tokens differ from the prompt's span")
            new_pos = torch.arange(span.start, span.end)
            old_pos = torch.arange(chunk.base_position, chunk.base_position + span.length)
            for li in range(self.w.num_layers):
                if deferred_rope:
                    k = layer_rope(self.w, li, chunk.pre_rope_k[li], new_pos)
                else:
                    k = self.move_keys(li, chunk.kv.k[li], old_pos, new_pos)
                kv.k[li, span.start : span.end] = k.to(self.kv_dtype)
            kv.v[:, span.start : span.end] = chunk.kv.v
        return kv

    def move_keys(
        self,
        layer: int,
        k: torch.Tensor,  # [n, num_kv_heads, head_dim] layer's post-RoPE keys at old_pos
        old_pos: torch.Tensor,  # [n]
        new_pos: torch.Tensor,  # [n]
    ) -> torch.Tensor:
        """# k's shape: ``layer``'s keys re-rotated to ``new_pos`` with that layer's own
        RoPE table (Gemma 3's local and global layers differ); ``k`` is not modified."""
        return rerotate(k, old_pos, new_pos, self.w.rope(layer).inv_freq)

    @torch.inference_mode()
    def first_layer_deviation(
        self,
        token_ids: torch.Tensor,  # [N]
        layout: PromptLayout,
        assembled: KVCache,
    ) -> torch.Tensor:
        """CacheBlend's online signal, # [N]: run layer 0 for every token, project the
        K/V of layer 1, and measure the L2 distance to the reused layer-1 K/V per
        token. Fresh tokens score 0 (they are computed regardless)."""
        n = token_ids.numel()
        work = assembled.clone()
        pos = torch.arange(n)
        out = forward_tokens(self.w, token_ids, pos, pos, work, pos, num_layers=1)
        _, k, v = project_qkv(self.w, self.w.layers[1], out.residual)
        k = layer_rope(self.w, 1, k, pos)
        dev = (k - assembled.k[1].to(k.dtype)).flatten(1).norm(dim=1) + (
            v - assembled.v[1].to(v.dtype)
        ).flatten(1).norm(dim=1)
        dev[torch.tensor(layout.fresh_indices(), dtype=torch.int64)] = 0.0
        return dev.to(torch.float32)

    @torch.inference_mode()
    def query_attention(
        self,
        token_ids: torch.Tensor,  # [N]
        layout: PromptLayout,
        assembled: KVCache,
        num_layers: int,
        prefix_hit: int = 0,
    ) -> torch.Tensor:
        """The query-aware signal, # [N]: the fresh tokens (and the last one) past the
        prefix run the first ``num_layers`` layers over a copy of ``assembled``; the
        question's queries (``query_positions``) score every slot at each of those layers
        (``question_attention``, with the model's attention scale), summed over them. The
        scoring sees every earlier slot, past a local layer's window too: it ranks tokens,
        it is not that layer's attention output."""
        n = token_ids.numel()
        fresh = torch.tensor(layout.fresh_indices() + [n - 1], dtype=torch.int64)
        idx = torch.unique(fresh[fresh >= prefix_hit])
        queries = query_positions(layout, prefix_hit)
        rows = torch.searchsorted(idx, queries)
        work = assembled.clone()
        total = torch.zeros(n)
        layers = min(num_layers, self.w.num_layers)

        def score(layer: int, q: torch.Tensor) -> None:  # q: [len(idx), H, D]
            total.add_(question_attention(q[rows], work.k[layer], queries, scale=self.w.attn_scale))

        forward_tokens(
            self.w,
            token_ids[idx],
            idx,
            idx,
            work,
            torch.arange(n),
            num_layers=layers,
            on_queries=score,
        )
        return total

    @torch.inference_mode()
    def recompute(
        self,
        token_ids: torch.Tensor,  # [N]
        assembled: KVCache,
        computed: Selection,
        on_queries: Callable[[int, torch.Tensor, KVCache], None] | None = None,
    ) -> ReuseResult:
        """Selective recomputation of ``computed`` (which must hold the last token)
        on a copy of ``assembled``; ``assembled`` itself is not modified.
        ``on_queries(layer, q, kv)`` sees each layer's post-RoPE queries of the computed
        tokens (# [len(computed), H, D]) once their K/V of that layer are in the copy
        ``kv``, as the served pass's attention sees them."""
        n = token_ids.numel()
        idx = computed.indices
        if idx.numel() == 0 or int(idx[-1]) != n - 1:
            raise ValueError("the computed set must include the last token (its logits)")
        kv = assembled.clone()
        hook = None if on_queries is None else (lambda li, q: on_queries(li, q, kv))
        out = forward_tokens(self.w, token_ids[idx], idx, idx, kv, torch.arange(n), on_queries=hook)
        return ReuseResult(kv, logits_of(self.w, out.hidden[-1:])[0], computed)

    def reuse(
        self,
        token_ids: torch.Tensor,  # [N]
        layout: PromptLayout,
        chunks: Sequence[ChunkKV],
        policy: SelectionPolicy,
        prefix_hit: int = 0,
        deferred_rope: bool = False,
    ) -> ReuseResult:
        """Assemble, select with ``policy``, and recompute: the whole reuse path."""
        assembled = self.assemble(token_ids, layout, chunks, deferred_rope)
        ctx = SelectionContext(
            layout=layout,
            rankings=tuple(c.ranking for c in chunks),
            deviation=lambda: self.first_layer_deviation(token_ids, layout, assembled),
            prefix_hit=prefix_hit,
            query_attention=lambda: self.query_attention(
                token_ids, layout, assembled, policy.config.qa_layers, prefix_hit
            ),
        )
        chosen = finalize(policy.select(ctx), layout, prefix_hit)
        return self.recompute(token_ids, assembled, chosen)

    @torch.inference_mode()
    def generate_batch(
        self,
        kvs: Sequence[KVCache],  # each [num_layers, N, num_kv_heads, head_dim], same N
        first_logits: torch.Tensor,  # [B, vocab] logits at each prompt's last position
        max_new_tokens: int,
    ) -> torch.Tensor:
        """# [B, max_new_tokens] greedy continuations of B prompts of equal length, one
        token of each per step: decoding is weight-bandwidth bound, so B sequences cost
        about as much as one. Same arithmetic as ``generate``; ``kvs`` are not modified."""
        b, n = len(kvs), kvs[0].num_tokens
        if first_logits.shape[0] != b or any(kv.num_tokens != n for kv in kvs):
            raise ValueError("generate_batch needs one logits row per KV, all of one length")
        w = self.w
        shape = (w.num_layers, b, n + max_new_tokens, w.num_kv_heads, w.head_dim)
        buf_k = torch.zeros(shape, dtype=self.kv_dtype)
        buf_v = torch.zeros(shape, dtype=self.kv_dtype)
        for i, kv in enumerate(kvs):
            buf_k[:, i, :n] = kv.k
            buf_v[:, i, :n] = kv.v
        out = torch.empty((b, max_new_tokens), dtype=torch.int64)
        logits = first_logits
        for step in range(max_new_tokens):
            out[:, step] = torch.argmax(logits, dim=-1)
            if step == max_new_tokens - 1:
                break
            logits = decode_step(w, out[:, step], n + step, buf_k, buf_v)
        return out

    def generate(
        self,
        kv: KVCache,  # [num_layers, N, num_kv_heads, head_dim] KV of the prompt
        first_logits: torch.Tensor,  # [vocab] logits at the prompt's last position
        max_new_tokens: int,
    ) -> torch.Tensor:
        """# [max_new_tokens] greedy continuation; ``kv`` is not modified."""
        return self.generate_batch([kv], first_logits[None], max_new_tokens)[0]
