"""Attention pieces of the chunk path that are not a backend.

- ``torch_native_phase_extend``: torch_native's extend for phase batches. SGLang's own loop
  attends each sub-request as a [seq_len x seq_len] causal SDPA with padded queries, so a
  phase with many runs of one row would cost runs x seq_len^2. This computes the same
  thing (each query sees its row's keys up to its own position) once per row, with the
  query rows only, and each sliding-window layer's window as SGLang's loop applies it. It
  is used for phase batches only; every other backend runs its own kernels unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention


class QueryBlock(NamedTuple):
    """Queries start..end-1 of a group (offsets among its queries) against its first
    ``keys`` keys. mask: # [end - start, keys] bool, the keys each query sees, or None
    where every key has its query (plain causal attention)."""

    start: int
    end: int
    keys: int
    mask: torch.Tensor | None


class AttnGroup(NamedTuple):
    """q_start, q_end: rows of this group's queries in the forward's token batch.
    key_slots: # [n_k] int64 KV-pool slots of the keys, in position order.
    q_index:   # [q_end - q_start] int64 index of each query among the keys.
    blocks:    how its queries are attended (``query_blocks``): built with the group, once
               per forward, since every layer attends the same way."""

    q_start: int
    q_end: int
    key_slots: torch.Tensor
    q_index: torch.Tensor
    blocks: tuple[QueryBlock, ...]


def query_blocks(q_index: torch.Tensor, num_keys: int) -> tuple[QueryBlock, ...]:  # [nq]
    """One causal block when every key has its query; otherwise the sorted queries cut
    into blocks (``block_cuts``), each against only the keys its last query sees. A full
    [nq, nk] boolean mask sends SDPA down its slow path on the CPU
    (``bench/query_blocks.py``), and a masked key still costs what a seen one does."""
    n = q_index.numel()
    if n == num_keys and bool((q_index == torch.arange(n, device=q_index.device)).all()):
        return (QueryBlock(0, n, n, None),)
    key_pos = torch.arange(num_keys, device=q_index.device)
    last_seen = (q_index + 1).tolist()  # host: keys up to each query, for the cuts
    blocks = []
    for s, e in block_cuts(last_seen):
        qi = q_index[s:e]
        hi = last_seen[e - 1]
        blocks.append(QueryBlock(s, e, hi, key_pos[None, :hi] <= qi[:, None]))
    return tuple(blocks)


def block_cuts(last_seen: list[int]) -> list[tuple[int, int]]:
    """Contiguous [start, end) blocks of queries sorted by position (``last_seen[i]``:
    the keys query i sees, non-decreasing) that minimise the attention work: a block
    attends every one of its queries to its last query's keys, and each block is one
    more SDPA call. Work is counted in query-key pairs, a call as ``_BLOCK_CALL_PAIRS``
    of them; cuts fall every ``_MIN_BLOCK`` queries (fewer rows waste the kernel's own
    query tiles), and a block holds at most ``_QUERY_BLOCK`` queries. A selection spread
    over a prompt, with the question's run at its end, is where fixed blocks of 128 lost
    most (``bench/query_blocks.py``)."""
    n = len(last_seen)
    cuts = [*range(0, n, _MIN_BLOCK), n]
    # best[j]: least work of the queries before cuts[j]; back[j]: where its last block starts.
    best = [0] * len(cuts)
    back = [0] * len(cuts)
    for j in range(1, len(cuts)):
        end, keys = cuts[j], last_seen[cuts[j] - 1]
        first = j - 1
        while first > 0 and end - cuts[first - 1] <= _QUERY_BLOCK:
            first -= 1
        best[j], back[j] = min(
            (best[i] + _BLOCK_CALL_PAIRS + (end - cuts[i]) * keys, i) for i in range(first, j)
        )
    blocks = []
    j = len(cuts) - 1
    while j:
        blocks.append((cuts[back[j]], cuts[j]))
        j = back[j]
    return blocks[::-1]


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
    window = sliding_window(layer)
    for g in groups:
        qg = q_[g.q_start : g.q_end].transpose(0, 1)  # [H, nq, D]
        # index_select copies whole rows; indexing with the slot tensor takes the generic
        # gather, slower on these rows (``bench/row_gather.py``).
        kg = k_cache.index_select(0, g.key_slots).transpose(0, 1).to(qg.dtype)  # [Hk, nk, D]
        vg = v_cache.index_select(0, g.key_slots).transpose(0, 1).to(qg.dtype)
        for blk in g.blocks:
            first, mask, causal = 0, blk.mask, blk.mask is None
            if window is not None:
                first, mask = windowed(g.q_index[blk.start : blk.end], blk.keys, window)
                causal = False
            out = scaled_dot_product_attention(
                qg[:, blk.start : blk.end].unsqueeze(0),
                kg[:, first : blk.keys].unsqueeze(0),
                vg[:, first : blk.keys].unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            rows = slice(g.q_start + blk.start, g.q_start + blk.end)
            o[rows] = out.squeeze(0).transpose(0, 1)
    return o.view(q_.shape[0], num_heads * v_dim)


def sliding_window(layer: Any) -> int | None:  # sglang RadixAttention
    """How many keys before its own a query of ``layer`` sees (SGLang's
    ``sliding_window_size``: its torch_native loop masks keys below q - size), or None for
    full attention."""
    size = getattr(layer, "sliding_window_size", None)
    return None if size is None or size < 0 else int(size)


def windowed(
    q_index: torch.Tensor,  # [nq] index of each query among the keys
    keys: int,
    window: int,
) -> tuple[int, torch.Tensor]:
    """The keys a block of queries sees under a sliding window: the first key any of them
    sees, and # [nq, keys - first] bool, key k seen by query q iff q - window <= k <= q."""
    first = max(0, int(q_index.min()) - window)  # host read: torch_native serves the CPU
    pos = torch.arange(first, keys, device=q_index.device)[None, :]
    q = q_index[:, None]
    return first, (pos <= q) & (pos >= q - window)


# The cost model of ``block_cuts``, chosen by timing SDPA on two CPU threads with
# SmolLM2-135M's heads over query sets recorded from the tools stream
# (``bench/query_blocks.py`` records and times them): a call is charged as 4k query-key
# pairs, more than its own overhead, since blocks of few queries also fill the kernel's
# query tiles less well; under 16 queries a block costs clearly more per pair.
_QUERY_BLOCK = 256
_MIN_BLOCK = 16
_BLOCK_CALL_PAIRS = 4096


def row_groups(
    req_pool_indices: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    req_to_token: torch.Tensor,  # [max_reqs, max_len]
) -> list[AttnGroup]:
    """Consecutive sub-requests of one row as one group: keys are the row's slots up to
    the longest of them, each query's index is its position in the row."""
    groups: list[AttnGroup] = []
    row = 0
    b = 0
    while b < len(req_pool_indices):
        idx = req_pool_indices[b]
        e = b
        while e + 1 < len(req_pool_indices) and req_pool_indices[e + 1] == idx:
            e += 1
        device = req_to_token.device
        q_index = torch.cat(
            [
                torch.arange(prefix_lens[j], prefix_lens[j] + extend_lens[j], device=device)
                for j in range(b, e + 1)
            ]
        )
        seq = max(prefix_lens[j] + extend_lens[j] for j in range(b, e + 1))
        n = q_index.numel()
        slots = req_to_token[idx, :seq].to(torch.int64)
        groups.append(AttnGroup(row, row + n, slots, q_index, query_blocks(q_index, seq)))
        row += n
        b = e + 1
    return groups


def torch_native_phase_extend(
    backend: Any,  # sglang TorchNativeAttnBackend
    q: torch.Tensor,  # [n, num_heads * head_dim]
    k: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
    v: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
    layer: Any,  # sglang RadixAttention
    forward_batch: Any,  # a phase batch (sgl_pic.binding.phases)
    groups: list[AttnGroup],  # ``row_groups`` of that batch, built once per forward
    save_kv_cache: bool = True,
) -> torch.Tensor:
    """torch_native's extend for a phase batch, same result as SGLang's loop (see module
    doc); # [n, num_heads * v_dim]. A sliding-window layer's queries see the keys SGLang's
    loop lets them see (``windowed``)."""
    if layer.is_cross_attention:
        raise NotImplementedError("sgl_pic: cross attention is unsupported")
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
