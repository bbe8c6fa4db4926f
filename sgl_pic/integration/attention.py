"""Attention for forwards whose queries are not one contiguous run per request.

Phase 1 runs chunks as sub-requests from position 0 over their own slots; phase 2 runs the
selected tokens of a request, scattered through it, against the whole assembled KV. Both
are described the same way: groups of query rows, each with the pool slots of its keys (in
position order) and each query's own index among those keys; a query sees keys at or before
its index (causal by global position). On a GPU the same groups map onto FlashInfer's paged
prefill with a custom mask; here they run through torch SDPA like SGLang's torch_native.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention

GROUPS_ATTR = "sgl_pic_attn_groups"
# LayerFeeds (sgl_pic.integration.layer_feed) whose layer l must be in the pool before
# layer l attends; set only while phase 2 runs.
FEEDS_ATTR = "sgl_pic_layer_feeds"
# A DeviationProbe while CacheBlend's online pass runs.
PROBE_ATTR = "sgl_pic_deviation_probe"


class DeviationProbe:
    """CacheBlend's signal, caught at the attention of layer ``layer`` (1: the first layer
    whose K/V depend on context): the fresh K/V of the pass's tokens against the reused
    K/V already in the pool at ``slots``. The forward is cut there (``ProbeDone``), so the
    pass costs layer 0 plus one projection, and layers >= ``layer`` write nothing."""

    def __init__(self, slots: torch.Tensor, layer: int = 1) -> None:
        self.slots = slots  # [n] pool slots of the pass's tokens, in row order
        self.layer = layer
        self.deviation: torch.Tensor | None = None  # [n] once caught

    def catch(self, pool: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: # [n, num_kv_heads * head_dim] or [n, num_kv_heads, head_dim]."""
        n = self.slots.numel()
        k_old = pool.get_key_buffer(self.layer)[self.slots].reshape(n, -1)
        v_old = pool.get_value_buffer(self.layer)[self.slots].reshape(n, -1)
        k_new = k.reshape(n, -1).to(k_old.dtype)
        v_new = v.reshape(n, -1).to(v_old.dtype)
        self.deviation = ((k_new - k_old).norm(dim=1) + (v_new - v_old).norm(dim=1)).float()
        raise ProbeDone


class ProbeDone(Exception):
    """Ends a deviation pass once its probe has caught layer ``layer``'s K/V."""


class AttnGroup(NamedTuple):
    """q_start, q_end: rows of this group's queries in the forward's token batch.
    key_slots: # [n_k] int64 KV-pool slots of the keys, in position order.
    q_index:   # [q_end - q_start] int64 index of each query among the keys."""

    q_start: int
    q_end: int
    key_slots: torch.Tensor
    q_index: torch.Tensor


def grouped_forward_extend(
    token_to_kv_pool: Any,
    q: torch.Tensor,  # [n, num_heads * head_dim]
    k: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
    v: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
    layer: Any,  # sglang RadixAttention
    out_cache_loc: torch.Tensor,  # [n] slots the new K/V are written to
    groups: list[AttnGroup],
    save_kv_cache: bool = True,
) -> torch.Tensor:
    """Writes K/V of the batch in place, then attends each group; # [n, num_heads * v_dim]."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(out_cache_loc, None), k, v)
    k_cache = token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = token_to_kv_pool.get_value_buffer(layer.layer_id)
    num_heads, qk_dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    q_ = q.view(-1, num_heads, qk_dim)
    o = q.new_empty((q_.shape[0], num_heads, v_dim))
    gqa = layer.tp_q_head_num != layer.tp_k_head_num
    for g in groups:
        qg = q_[g.q_start : g.q_end].transpose(0, 1)  # [H, nq, D]
        kg = k_cache[g.key_slots].transpose(0, 1).to(qg.dtype)  # [Hk, nk, D]
        vg = v_cache[g.key_slots].transpose(0, 1).to(qg.dtype)
        nk = g.key_slots.numel()
        if g.q_end - g.q_start == nk and bool(
            (g.q_index == torch.arange(nk, device=g.q_index.device)).all()
        ):
            # Every key has its query (phase 1, or a prompt recomputed in full): plain causal
            # attention, which takes SDPA's fused kernels instead of a materialised mask.
            out = scaled_dot_product_attention(
                qg.unsqueeze(0),
                kg.unsqueeze(0),
                vg.unsqueeze(0),
                is_causal=True,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            o[g.q_start : g.q_end] = out.squeeze(0).transpose(0, 1)
            continue
        # Scattered queries: blocks of queries against only the keys they can see. A full
        # [nq, nk] boolean mask sends SDPA down its slow path on the CPU (about 7x slower at
        # 2k tokens), and the causal cut skips keys no query of the block reaches.
        q_index = g.q_index.to(qg.device)
        key_pos = torch.arange(nk, device=qg.device)
        for s in range(0, q_index.numel(), _QUERY_BLOCK):
            qi = q_index[s : s + _QUERY_BLOCK]
            hi = int(qi.max()) + 1
            out = scaled_dot_product_attention(
                qg[:, s : s + _QUERY_BLOCK].unsqueeze(0),
                kg[:, :hi].unsqueeze(0),
                vg[:, :hi].unsqueeze(0),
                attn_mask=key_pos[None, :hi] <= qi[:, None],
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            rows = slice(g.q_start + s, g.q_start + s + qi.numel())
            o[rows] = out.squeeze(0).transpose(0, 1)
    return o.view(q_.shape[0], num_heads * v_dim)


_QUERY_BLOCK = 128


def torch_native_forward_extend_hook(
    original: Any,
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: Any,
    forward_batch: Any,
    save_kv_cache: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """AROUND hook on TorchNativeAttnBackend.forward_extend: grouped attention while an
    sgl_pic phase runs, SGLang's own path otherwise."""
    groups = getattr(forward_batch, GROUPS_ATTR, None)
    if groups is None:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    if layer.is_cross_attention or getattr(layer, "sliding_window_size", -1) not in (None, -1):
        raise NotImplementedError("sgl_pic: cross attention and sliding windows are unsupported")
    probe = getattr(forward_batch, PROBE_ATTR, None)
    if probe is not None and layer.layer_id == probe.layer and k is not None and v is not None:
        probe.catch(backend.token_to_kv_pool, k, v)
    for feed in getattr(forward_batch, FEEDS_ATTR, None) or ():
        feed.before_layer(layer.layer_id)
    return grouped_forward_extend(
        backend.token_to_kv_pool,
        q,
        k,
        v,
        layer,
        forward_batch.out_cache_loc,
        groups,
        save_kv_cache,
    )
