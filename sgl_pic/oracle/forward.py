"""The one forward primitive every oracle path is built from.

``forward_tokens`` pushes a set of tokens through the decoder layer by layer against a
KV buffer. At each layer the tokens' fresh K/V overwrite their slots in the buffer
*before* attention, and each token attends, causally by global position, to the whole
buffer. With every token selected this is an ordinary prefill; with a subset and a
buffer of reused KV it is DARIC's Eq. 1 / Algorithm 2 and CacheTune's selective
recomputation: later layers of a selected token see the updated K/V of every other
selected token at that layer, and stale reused KV elsewhere.

Every layer rotates with its own RoPE table and attends within its own window
(``ModelWeights.rope``, ``ModelWeights.window``): one table and full attention for the
Llama family, local and global layers for Gemma 3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sgl_pic.oracle.model_weights import LayerWeights, MlpActivation, ModelWeights
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


def rms_norm(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """RMSNorm in float32. Llama scales the result, cast back to x's dtype, by ``weight``;
    Gemma (``unit_offset``) scales by ``1 + weight`` in float32, then casts, as each
    family's own implementation does (they differ in a lower dtype)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.to(torch.float32))).to(x.dtype)
    return weight * xf.to(x.dtype)


def norm(w: ModelWeights, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """# x's shape: the model's RMSNorm of x # [..., dim] with ``weight`` # [dim]."""
    return rms_norm(x, weight, w.rms_eps, w.unit_offset_norms)


def embed_tokens(w: ModelWeights, token_ids: torch.Tensor) -> torch.Tensor:
    """# [n, hidden] input of the first layer for token_ids # [n]."""
    h = F.embedding(token_ids, w.embed)
    if w.embed_scale is None:
        return h
    # Gemma rounds the factor to the embedding dtype before multiplying.
    return h * torch.tensor(w.embed_scale, dtype=torch.float32).to(h.dtype)


def project_qkv(
    w: ModelWeights,
    layer: LayerWeights,
    h: torch.Tensor,  # [n, hidden] layer input
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-RoPE q # [n, H, D], k # [n, Hkv, D], v # [n, Hkv, D] (Qwen3, Gemma 3: after
    the per-head q/k norms, which come before RoPE, so pre-RoPE keys include them)."""
    x = norm(w, h, layer.input_norm)
    q = F.linear(x, layer.q_proj, layer.q_bias).view(-1, w.num_heads, w.head_dim)
    k = F.linear(x, layer.k_proj, layer.k_bias).view(-1, w.num_kv_heads, w.head_dim)
    v = F.linear(x, layer.v_proj, layer.v_bias).view(-1, w.num_kv_heads, w.head_dim)
    if layer.q_norm is not None:
        q = norm(w, q, layer.q_norm)
    if layer.k_norm is not None:
        k = norm(w, k, layer.k_norm)
    return q, k, v


def layer_rope(
    w: ModelWeights,
    li: int,
    x: torch.Tensor,  # [..., n, heads, D] pre-RoPE queries or keys of layer li
    positions: torch.Tensor,  # [n]
) -> torch.Tensor:
    """# x's shape: x rotated to ``positions`` with layer ``li``'s own table."""
    rope = w.rope(li)
    return apply_rope(x, positions, rope.inv_freq, scale=rope.attention_scaling)


def attention(
    w: ModelWeights,
    q: torch.Tensor,  # [n, H, D] post-RoPE queries
    k: torch.Tensor,  # [N, Hkv, D] post-RoPE keys of the whole buffer
    v: torch.Tensor,  # [N, Hkv, D]
    q_pos: torch.Tensor,  # [n] global positions of the queries
    k_pos: torch.Tensor,  # [N] global positions of the buffer slots
    window: int | None = None,
) -> torch.Tensor:
    """# [n, H * D]: each query attends to every slot at a position <= its own and, with a
    ``window``, more than ``window`` positions back from it (``0 <= i - j < window``)."""
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
        lo, hi = 0, k_pos.numel()
        if sorted_keys:
            hi = int(torch.searchsorted(k_pos, qp.max(), right=True))
            if window is not None:
                lo = int(torch.searchsorted(k_pos, qp.min() - window, right=True))
        kp = k_pos[None, lo:hi]
        mask = kp <= qp[:, None]  # [b, hi - lo]
        if window is not None:
            mask &= kp > qp[:, None] - window
        b = qp.numel()
        blk = qq[:, :, s : s + block].reshape(w.num_kv_heads, group * b, w.head_dim)
        res = F.scaled_dot_product_attention(
            blk, kk[:, lo:hi], vv[:, lo:hi], attn_mask=mask.repeat(group, 1), scale=w.attn_scale
        )
        out[:, :, s : s + block] = res.view(w.num_kv_heads, group, b, w.head_dim)
    return out.permute(2, 0, 1, 3).reshape(n, -1)


_QUERY_BLOCK = 128


def mlp(
    layer: LayerWeights,
    x: torch.Tensor,  # [n, hidden] normalised MLP input
    activation: MlpActivation = "silu",
) -> torch.Tensor:
    """# [n, hidden]: SwiGLU, or GeGLU with the tanh GELU (Gemma)."""
    gate = F.linear(x, layer.gate_proj)
    gate = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return F.linear(gate * F.linear(x, layer.up_proj), layer.down_proj)


def finish_layer(
    w: ModelWeights,
    layer: LayerWeights,
    h: torch.Tensor,  # [n, hidden] the layer's input (residual stream)
    attn: torch.Tensor,  # [n, H * D] attention output, before o_proj
) -> torch.Tensor:
    """# [n, hidden] the layer's output: o_proj and the MLP added to the residual stream,
    each sublayer's output normalised first where the model does (Gemma)."""
    out = F.linear(attn, layer.o_proj, layer.o_bias)
    if layer.attn_out_norm is not None:
        out = norm(w, out, layer.attn_out_norm)
    h = h + out
    out = mlp(layer, norm(w, h, layer.post_norm), w.mlp_activation)
    if layer.mlp_out_norm is not None:
        out = norm(w, out, layer.mlp_out_norm)
    return h + out


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
    h = embed_tokens(w, token_ids)
    pre: list[torch.Tensor] = []
    for li in range(n_layers):
        layer = w.layers[li]
        q, k, v = project_qkv(w, layer, h)
        if keep_pre_rope:
            pre.append(k.clone())
        q, k = layer_rope(w, li, q, positions), layer_rope(w, li, k, positions)
        kv.k[li, slots] = k.to(kv.k.dtype)
        kv.v[li, slots] = v.to(kv.v.dtype)
        if on_queries is not None:
            on_queries(li, q)
        attn = attention(w, q, kv.k[li], kv.v[li], positions, slot_positions, w.window(li))
        h = finish_layer(w, layer, h, attn)
    hidden = norm(w, h, w.final_norm) if n_layers == w.num_layers else None
    return ForwardResult(h, hidden, torch.stack(pre) if keep_pre_rope and pre else None)


def decode_step(
    w: ModelWeights,
    token_ids: torch.Tensor,  # [B] one new token per sequence
    position: int,  # the new tokens' position, the same in every sequence
    buf_k: torch.Tensor,  # [num_layers, B, L, num_kv_heads, head_dim]; slot = position
    buf_v: torch.Tensor,  # [num_layers, B, L, num_kv_heads, head_dim]
) -> torch.Tensor:
    """# [B, vocab] float32 next-token logits after the new tokens, whose K/V are written
    into the buffers at slot ``position``; slots before it must hold the sequences' KV."""
    b, group = token_ids.numel(), w.num_heads // w.num_kv_heads
    positions = torch.full((b,), position, dtype=torch.int64)
    h = embed_tokens(w, token_ids)  # [B, hidden]
    for li, layer in enumerate(w.layers):
        q, k, v = project_qkv(w, layer, h)
        q = layer_rope(w, li, q, positions)
        buf_k[li, :, position] = layer_rope(w, li, k, positions)
        buf_v[li, :, position] = v
        window = w.window(li)
        lo = 0 if window is None else max(0, position - window + 1)
        # Every visible slot precedes the new token: no mask.
        attn = F.scaled_dot_product_attention(
            q.view(b, w.num_kv_heads, group, w.head_dim),
            buf_k[li, :, lo : position + 1].transpose(1, 2),
            buf_v[li, :, lo : position + 1].transpose(1, 2),
            scale=w.attn_scale,
        )
        h = finish_layer(w, layer, h, attn.reshape(b, -1))
    return logits_of(w, norm(w, h, w.final_norm))


def logits_of(w: ModelWeights, hidden: torch.Tensor) -> torch.Tensor:
    """# [n, vocab] float32 logits of final hidden states # [n, hidden]."""
    return F.linear(hidden, w.lm_head).to(torch.float32)
