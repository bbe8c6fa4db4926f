"""The one forward primitive every oracle path is built from.

``forward_tokens`` pushes a set of tokens through the decoder layer by layer against a
KV buffer. At each layer the tokens' fresh K/V overwrite their slots in the buffer
*before* attention, and each token attends, causally by global position, to the whole
buffer. With every token selected this is an ordinary prefill; with a subset and a
buffer of reused KV it is DARIC's Eq. 1 / Algorithm 2 and CacheTune's selective
recomputation: later layers of a selected token see the updated K/V of every other
selected token at that layer, and stale reused KV elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sgl_pic.oracle.weights import LayerWeights, ModelWeights
from sgl_pic.rope import apply_rope


class KVCache(NamedTuple):
    """Per-layer keys and values of a token sequence (keys after RoPE unless a field
    says otherwise)."""

    k: torch.Tensor  # [num_layers, num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_layers, num_tokens, num_kv_heads, head_dim]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    def clone(self) -> KVCache:
        return KVCache(self.k.clone(), self.v.clone())


class ForwardResult(NamedTuple):
    residual: torch.Tensor  # [num_selected, hidden] residual stream after the last layer run
    hidden: torch.Tensor | None  # [num_selected, hidden] final-norm output; None if partial
    pre_rope_k: torch.Tensor | None  # [num_layers_run, num_selected, num_kv_heads, head_dim]


def empty_kv(w: ModelWeights, num_tokens: int, dtype: torch.dtype) -> KVCache:
    shape = (w.num_layers, num_tokens, w.num_kv_heads, w.head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def project_qkv(
    w: ModelWeights,
    layer: LayerWeights,
    h: torch.Tensor,  # [n, hidden] layer input
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-RoPE q # [n, H, D], k # [n, Hkv, D], v # [n, Hkv, D] (Qwen3: after the
    per-head q/k norms, which come before RoPE, so pre-RoPE keys include them)."""
    x = rms_norm(h, layer.input_norm, w.rms_eps)
    q = F.linear(x, layer.q_proj, layer.q_bias).view(-1, w.num_heads, w.head_dim)
    k = F.linear(x, layer.k_proj, layer.k_bias).view(-1, w.num_kv_heads, w.head_dim)
    v = F.linear(x, layer.v_proj, layer.v_bias).view(-1, w.num_kv_heads, w.head_dim)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, w.rms_eps)
    if layer.k_norm is not None:
        k = rms_norm(k, layer.k_norm, w.rms_eps)
    return q, k, v


def attention(
    w: ModelWeights,
    q: torch.Tensor,  # [n, H, D] post-RoPE queries
    k: torch.Tensor,  # [N, Hkv, D] post-RoPE keys of the whole buffer
    v: torch.Tensor,  # [N, Hkv, D]
    q_pos: torch.Tensor,  # [n] global positions of the queries
    k_pos: torch.Tensor,  # [N] global positions of the buffer slots
) -> torch.Tensor:
    """# [n, H * D]: each query attends to every slot at a position <= its own."""
    n, group = q.shape[0], w.num_heads // w.num_kv_heads
    # Grouped-query attention without copying K/V per query head: the `group` query
    # heads sharing one KV head are stacked along the query axis.
    qq = q.view(n, w.num_kv_heads, group, w.head_dim).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
    kk, vv = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, N, D]
    out = torch.empty_like(qq)
    # Blocks of queries against only the keys they can see: on the CPU a full [n, N]
    # boolean mask takes SDPA's slow path, and the causal cut halves the work. Needs slot
    # positions sorted, as every caller has.
    sorted_keys = k_pos.numel() < 2 or bool((k_pos[1:] >= k_pos[:-1]).all())
    block = _QUERY_BLOCK if sorted_keys else n
    for s in range(0, n, block):
        qp = q_pos[s : s + block]
        hi = int(torch.searchsorted(k_pos, qp.max(), right=True)) if sorted_keys else k_pos.numel()
        mask = k_pos[None, :hi] <= qp[:, None]  # [b, hi]
        b = qp.numel()
        blk = qq[:, :, s : s + block].reshape(w.num_kv_heads, group * b, w.head_dim)
        res = F.scaled_dot_product_attention(
            blk, kk[:, :hi], vv[:, :hi], attn_mask=mask.repeat(group, 1)
        )
        out[:, :, s : s + block] = res.view(w.num_kv_heads, group, b, w.head_dim)
    return out.permute(2, 0, 1, 3).reshape(n, -1)


_QUERY_BLOCK = 128


def mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:  # x: [n, hidden]
    gated = F.silu(F.linear(x, layer.gate_proj)) * F.linear(x, layer.up_proj)
    return F.linear(gated, layer.down_proj)


def forward_tokens(
    w: ModelWeights,
    token_ids: torch.Tensor,  # [n] ids of the tokens pushed through
    positions: torch.Tensor,  # [n] their global positions
    slots: torch.Tensor,  # [n] their slots in the buffer (written in place)
    kv: KVCache,  # buffer of N slots; modified in place
    slot_positions: torch.Tensor,  # [N] global position of every buffer slot
    keep_pre_rope: bool = False,
    num_layers: int | None = None,
    on_queries: Callable[[int, torch.Tensor], None] | None = None,
) -> ForwardResult:
    """Run the first ``num_layers`` layers (all by default) for the given tokens,
    overwriting their K/V in ``kv`` at every layer run. Returns their residual stream
    and, when every layer ran, their hidden states after the final norm.
    ``on_queries(layer, q)`` sees each layer's post-RoPE queries (# [n, H, D]) once the
    tokens' K/V of that layer are in ``kv``, before attention."""
    n_layers = w.num_layers if num_layers is None else num_layers
    h = F.embedding(token_ids, w.embed)
    pre: list[torch.Tensor] = []
    for li in range(n_layers):
        layer = w.layers[li]
        q, k, v = project_qkv(w, layer, h)
        if keep_pre_rope:
            pre.append(k.clone())
        q = apply_rope(q, positions, w.inv_freq, scale=w.rope_scale)
        k = apply_rope(k, positions, w.inv_freq, scale=w.rope_scale)
        kv.k[li, slots] = k.to(kv.k.dtype)
        kv.v[li, slots] = v.to(kv.v.dtype)
        if on_queries is not None:
            on_queries(li, q)
        attn = attention(w, q, kv.k[li], kv.v[li], positions, slot_positions)
        h = h + F.linear(attn, layer.o_proj, layer.o_bias)
        h = h + mlp(layer, rms_norm(h, layer.post_norm, w.rms_eps))
    hidden = rms_norm(h, w.final_norm, w.rms_eps) if n_layers == w.num_layers else None
    return ForwardResult(h, hidden, torch.stack(pre) if keep_pre_rope and pre else None)


def logits_of(w: ModelWeights, hidden: torch.Tensor) -> torch.Tensor:
    """# [n, vocab] float32 logits of final hidden states # [n, hidden]."""
    return F.linear(hidden, w.lm_head).to(torch.float32)
