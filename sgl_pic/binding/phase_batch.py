"""A phase forward's batch: sub-requests over rows of SGLang's request table, and the
``ForwardBatch`` built from the live one for them (``build_phase_batch``).

Split from ``phases`` (which runs these batches): this is the data a phase forward is
made of (its sub-requests: ``core.runs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from sgl_pic.core.runs import SubRequest
from sgl_pic.engine.device_copy import to_device


class PhaseBatch(NamedTuple):
    """What the attention backend is given for one phase forward (checked by tests)."""

    forward_batch: Any  # sglang ForwardBatch
    subrequests: tuple[SubRequest, ...]


def build_phase_batch(
    live: Any,  # the ForwardBatch SGLang built for this iteration
    subrequests: Sequence[SubRequest],
    input_ids: torch.Tensor,  # [sum extend] token ids, sub-request by sub-request
    req_to_token: torch.Tensor,  # [max_reqs, max_len] SGLang's request-to-slot table
    translator: Any | None,  # model_runner.kv_index_translator, or None (tests)
) -> PhaseBatch:
    """A new ForwardBatch (the live one is not changed) for ``subrequests``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    device = live.input_ids.device
    subs = tuple(subrequests)
    prefix = [s.prefix for s in subs]
    ext = [s.extend for s in subs]
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    if input_ids.numel() != sum(ext):
        raise ValueError(f"{input_ids.numel()} input ids for {sum(ext)} extend tokens")
    out_loc = torch.cat([req_to_token[s.pool_idx, s.prefix : s.prefix + s.extend] for s in subs])
    pool_idx = [s.pool_idx for s in subs]
    # Every per-batch tensor the host knows, made on the host and sent in one copy (each
    # ``torch.tensor(..., device=)`` would be a blocking copy from pageable memory).
    # Positions first: the one long field starts the buffer, aligned.
    starts = [0, *accumulate(ext)][: len(subs)]
    fields = pool_idx + seq + prefix + ext + starts
    meta = torch.tensor(fields, dtype=torch.int64)  # host: sent in one copy
    n = len(subs)
    ext_h, starts_h = meta[3 * n : 4 * n], meta[4 * n :]
    # Batch row t of sub-request j is its token t - start_j: position prefix_j + t - start_j.
    shift = torch.repeat_interleave(meta[2 * n : 3 * n] - starts_h, ext_h)
    pos = torch.arange(sum(ext), dtype=torch.int64) + shift  # host: sent with meta
    on_dev = to_device(torch.cat([pos, meta]), device).split([pos.numel(), n, n, n, n, n])
    pos_d, rows_d, seq_d, prefix_d, ext_d, start_d = on_dev
    seq_dtype = live.seq_lens.dtype
    ext_t = ext_d.to(torch.int32)
    fb = dataclasses.replace(
        live,
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(subs),
        input_ids=input_ids.to(device=device, dtype=live.input_ids.dtype),
        req_pool_indices=rows_d.to(live.req_pool_indices.dtype),
        req_pool_indices_cpu=torch.tensor(pool_idx, dtype=torch.int64),  # host: SGLang's own
        seq_lens=seq_d.to(seq_dtype),
        seq_lens_cpu=torch.tensor(seq, dtype=seq_dtype),  # host: SGLang keeps it on the host
        orig_seq_lens=seq_d.to(seq_dtype, copy=True),
        seq_lens_sum=sum(seq),
        out_cache_loc=out_loc.to(device=device, dtype=live.out_cache_loc.dtype),
        origin_out_cache_loc=None,
        out_cache_loc_virtual=None,
        kv_loc_plan=None,
        kv_loc_cols=None,
        positions=pos_d,
        extend_num_tokens=sum(ext),
        extend_seq_lens=ext_t,
        extend_prefix_lens=prefix_d.to(torch.int32),
        extend_start_loc=start_d.to(torch.int32),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=ext,
        extend_logprob_start_lens_cpu=ext,
        extend_input_logprob_token_ids_gpu=None,
        return_logprob=False,
        top_logprobs_nums=None,
        token_ids_logprobs=None,
        lora_ids=None,
        rids=None,
        mrope_positions=None,
        input_embeds=None,
        forward_metadata_ready=False,
        forward_metadata_planned_bs=None,
        forward_metadata_planned_num_tokens=None,
        token_indices_to_pool=None,
        is_extend_in_batch=True,
        next_token_logits_buffer=None,
        # Per-batch state the phase batch does not share with the live one: split
        # batches, context parallelism, multimodal and multi-item inputs, a caller's
        # attention output buffer, token-padding counts (recounted below).
        tbo_split_seq_index=None,
        tbo_children=None,
        tbo_parent_token_range=None,
        tbo_padded_len=None,
        attn_cp_metadata=None,
        attn_dcp_metadata=None,
        dcp_kv_mask=None,
        multi_item_delimiter_indices=None,
        mm_inputs=None,
        mm_token_modalities=None,
        replace_embeds=None,
        replace_positions=None,
        token_type_ids=None,
        encoder_lens=None,
        spec_info=None,
        ngram_embedding_info=None,
        aux_hidden_states_buffer=None,
        hidden_states=None,
        residual=None,
        _attn_output=None,
        num_token_non_padded=None,
        global_num_token_non_padded=None,
        global_num_token_non_padded_cpu=None,
    )
    if translator is not None:
        translator.own_plan(fb).bind(fb, translator)
    if getattr(live, "global_num_token_non_padded", None) is not None:
        # Set by SGLang only where token padding is masked (MoE all-to-all): recount.
        fb._init_num_token_non_padded(device=device, is_draft_worker=False)
    if getattr(live, "global_num_token_non_padded_cpu", None) is not None:
        fb.global_num_token_non_padded_cpu = sum(ext)
    return PhaseBatch(fb, subs)
