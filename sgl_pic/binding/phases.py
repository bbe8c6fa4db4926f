"""Phase forwards as SGLang-native extend batches.

Every forward the chunk path runs is described as ordinary extend sub-requests, each a
row of SGLang's ``req_to_token`` with a prefix and an extend length:

- a missing chunk (phase 1) is a sub-request from position 0 over its own slots, on a
  scratch row that holds just those slots;
- a contiguous run of selected tokens (phase 2) is a sub-request whose prefix is its
  request's own row up to the run's start; several runs share one row;
- a plain request of the batch is itself.

The batch is built from the live ``ForwardBatch`` (``dataclasses.replace``), given its own
KV-location plan by SGLang's translator, planned by the attention backend that serves
extend batches (``extend_backend``) through ``init_forward_metadata``, and run through the
model's decoder stack. FlashInfer, FA3, triton and torch_native attend it with their own
kernels. The two-phase semantics need every new K/V of a layer written before any query
of that layer attends, so that a run sees the fresh K/V of earlier runs of its request
(and the reused KV elsewhere). In SGLang 0.5.23 FA3 (``flash_attn_with_kvcache`` over the
rows' page table), triton (its extend kernel reads each prefix from the pool) and
torch_native (``attention.torch_native_phase_extend``) write first. FlashInfer's ragged
extend attends the prefix through its paged wrapper before it writes, so phase batches are
planned on its paged path (``use_paged`` while planning: ``init_forward_metadata`` then
plans ``use_ragged=False``), which writes first; ``PhaseRunner.prepare`` checks that plan.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from sgl_pic.binding.attention import AttnGroup, row_groups


class Run(NamedTuple):
    """Positions start..end-1 of one request, recomputed as one sub-request."""

    start: int
    end: int


class SubRequest(NamedTuple):
    """Queries at positions prefix..prefix+extend-1 of ``req_to_token[pool_idx]``; keys
    are that row's first prefix+extend slots, and the queries' K/V go to the row's slots
    prefix..prefix+extend-1."""

    pool_idx: int
    prefix: int
    extend: int


def attended_keys(subs: Sequence[SubRequest]) -> int:
    """Keys the queries of ``subs`` attend, summed: a query at position p sees its row's
    first p + 1 keys. Over the number of queries it is the attention work per computed
    token, which for a prompt prefilled whole is (len + 1) / 2."""
    return sum(s.extend * s.prefix + s.extend * (s.extend + 1) // 2 for s in subs)


def pinnable(device: torch.device) -> bool:
    """Whether copies to ``device`` go through pinned host memory: CUDA's only (on a CPU
    "device" there is nothing to copy)."""
    return device.type == "cuda"


def to_device(
    host: torch.Tensor,  # [...] host tensor
    device: torch.device,
) -> torch.Tensor:
    """# [...] ``host`` on ``device``, without the host waiting: a copy from pageable
    memory blocks until the stream reaches it, one from pinned memory with ``non_blocking``
    does not (the caching host allocator keeps the pinned block until the copy has run)."""
    if not pinnable(device):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PhaseBatch(NamedTuple):
    """What the attention backend is given for one phase forward (checked by tests)."""

    forward_batch: Any  # sglang ForwardBatch
    subrequests: tuple[SubRequest, ...]


def runs_of(positions: torch.Tensor, merge_gap: int = 0) -> list[Run]:
    """Half-open runs [start, end) covering the sorted distinct ``positions`` (# [k]);
    runs separated by at most ``merge_gap`` unselected tokens become one (those tokens
    are then recomputed too, which only brings the result closer to exact)."""
    if positions.numel() == 0:
        return []
    pos = positions.tolist()
    runs = [[pos[0], pos[0] + 1]]
    for p in pos[1:]:
        if p - runs[-1][1] <= merge_gap:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [Run(a, b) for a, b in runs]


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


_HYBRID = "sglang.srt.layers.attention.hybrid_attn_backend"
_FLASHINFER = "sglang.srt.layers.attention.flashinfer_backend"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend"


def _is_instance(obj: Any, module: str, name: str) -> bool:
    """isinstance of SGLang's ``module.name``, without importing it: an object of a class
    whose module was never imported is not one (FlashInfer's module imports flashinfer)."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(obj, getattr(mod, name))


def extend_backend(backend: Any) -> Any:  # sglang AttentionBackend
    """The backend that plans and attends extend batches under ``backend`` (the model
    runner's): SGLang's HybridAttnBackend (prefill and decode backends differ) sends every
    extend batch to its ``prefill_backend``; any other backend serves them itself.
    FlashInfer's own ``prefill_backend`` is a kernel name ("fa2"), not a backend."""
    if _is_instance(backend, _HYBRID, "HybridAttnBackend"):
        return backend.prefill_backend
    return backend


LayerFn = Callable[[int], None]
# (layer, RadixAttention, its post-RoPE queries # [n, heads * head_dim])
AttentionFn = Callable[[int, Any, "torch.Tensor | None"], None]


@dataclasses.dataclass
class PhaseContext:
    """The state of the phase forward under way: the one thing the decoder-layer and
    attention hooks read (``PhaseRunner.layer_start`` / ``layer_end`` / ``attention_end``
    and the torch_native extend hook). It exists only inside ``PhaseRunner.running``,
    which always takes it down again, so no callback or batch of one forward outlives it.

    batch:          the phase batch's ForwardBatch (what the attention hooks act on).
    before_layer:   called with l before decoder layer l (the layer feed's loads).
    after_layer:    called with l after decoder layer l (CacheBlend's deviation probe).
    after_attention: called after layer l's RadixAttention (the query probe).
    groups:         the batch's sub-requests grouped by request row, built on the first
                    layer that asks (``PhaseRunner.row_groups``) and reused by the others."""

    batch: Any
    before_layer: tuple[LayerFn, ...] = ()
    after_layer: tuple[LayerFn, ...] = ()
    after_attention: tuple[AttentionFn, ...] = ()
    groups: list[AttnGroup] | None = None


class PhaseRunner:
    """Runs phase batches through SGLang: the backend plans each one, then the model's
    decoder stack runs it. ``stack(ids, positions, forward_batch)`` is the decoder stack's
    original forward; ``backend`` the model runner's attention backend.

    ``context`` is the phase forward under way (None between forwards), set and reset only
    by ``running``: the attention and layer hooks act only on it, so SGLang's own forwards
    never see phase state. Worker side: every method runs on the scheduler's forward
    thread."""

    def __init__(
        self,
        backend: Any,
        req_to_token: torch.Tensor,  # [max_reqs, max_len]
        translator: Any | None,
        req_pool: Any | None,  # SGLang's ReqToTokenPool, for phase 1's scratch rows
    ) -> None:
        self.backend = backend
        self._planner = extend_backend(backend)
        self._flashinfer = _is_instance(self._planner, _FLASHINFER, "FlashInferAttnBackend")
        self.req_to_token = req_to_token
        self.translator = translator
        self.req_pool = req_pool
        self.context: PhaseContext | None = None

    @property
    def batch(self) -> Any | None:
        """The ForwardBatch of the phase forward under way, None between them."""
        return None if self.context is None else self.context.batch

    def prepare(
        self, live: Any, subrequests: Sequence[SubRequest], input_ids: torch.Tensor
    ) -> PhaseBatch:
        """The phase batch of ``subrequests`` (# [sum extend] ``input_ids``), planned by
        the attention backend: after this the backend's metadata describes it."""
        phase = build_phase_batch(live, subrequests, input_ids, self.req_to_token, self.translator)
        planner = self._planner
        if not self._flashinfer:
            self.backend.init_forward_metadata(phase.forward_batch)
            return phase
        # FlashInfer plans ragged unless ``use_paged`` (or multimodal, multi-item scoring,
        # deterministic inference); its ragged extend attends the prefix before this
        # layer's writes (see module doc). The flag is read only while planning.
        saved = planner.use_paged
        planner.use_paged = True
        try:
            self.backend.init_forward_metadata(phase.forward_batch)
        finally:
            planner.use_paged = saved
        if planner.forward_metadata.use_ragged:
            # Raised, the batch runs without reuse (plugin); served, it would read stale KV.
            raise RuntimeError("sgl_pic: FlashInfer planned a phase batch on its ragged path")
        return phase

    @property
    def max_subrequests(self) -> int | None:
        """Sub-requests one phase batch may hold: backends size their per-request plan
        buffers by SGLang's request table (None: no limit). Past it the executor merges
        runs, so a request's recomputed set would depend on its batch; torch_native plans
        nothing per request (phase batches take ``torch_native_phase_extend``), so it
        never merges."""
        if self.req_pool is None or _is_instance(
            self._planner, _TORCH_NATIVE, "TorchNativeAttnBackend"
        ):
            return None
        return int(self.req_pool.size)

    @contextmanager
    def running(
        self,
        phase: PhaseBatch,
        before_layer: Sequence[LayerFn] = (),
        after_layer: Sequence[LayerFn] = (),
        after_attention: Sequence[AttentionFn] = (),
    ) -> Iterator[PhaseContext]:
        """The one way into a phase forward's context: sets it for ``phase`` with these
        callbacks, and takes all of it down when the block ends, however it ends (an
        exception, a probe cutting the pass short). Phase forwards never nest."""
        if self.context is not None:
            raise RuntimeError("sgl_pic: a phase forward is already under way")
        self.context = PhaseContext(
            phase.forward_batch, tuple(before_layer), tuple(after_layer), tuple(after_attention)
        )
        try:
            yield self.context
        finally:
            self.context = None

    def run(
        self,
        stack: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
        phase: PhaseBatch,
        before_layer: Sequence[LayerFn] = (),
        after_layer: Sequence[LayerFn] = (),
        after_attention: Sequence[AttentionFn] = (),
    ) -> torch.Tensor:
        """# [sum extend, hidden] the decoder stack's output over ``phase``, the callbacks
        called by the layer and attention hooks during it (``running``)."""
        fb = phase.forward_batch
        with self.running(phase, before_layer, after_layer, after_attention):
            return stack(fb.input_ids, fb.positions, fb)

    def row_groups(self) -> list[AttnGroup]:
        """The running phase batch's sub-requests grouped by request row
        (``attention.row_groups``), built on the first layer and reused by the others."""
        ctx = self.context
        assert ctx is not None, "no phase batch is running"
        if ctx.groups is None:
            fb = ctx.batch
            ctx.groups = row_groups(
                fb.req_pool_indices_cpu.tolist(),  # host copy: no device read
                list(fb.extend_prefix_lens_cpu),
                list(fb.extend_seq_lens_cpu),
                self.req_to_token,
            )
        return ctx.groups

    def scratch_rows(self, n: int) -> list[int] | None:
        """``n`` free rows of SGLang's request table for phase 1 (None when fewer are
        free); given back by ``free_rows`` before the forward returns."""
        if self.req_pool is None:
            return None
        return self.req_pool.alloc_rows(n)

    def free_rows(self, rows: list[int]) -> None:
        if not rows or self.req_pool is None:
            return
        if self.req_to_token.is_cuda:
            # The next batch may take these rows and rewrite them: the kernels that read
            # them must have run first.
            torch.cuda.current_stream(self.req_to_token.device).synchronize()
        self.req_pool.free_rows(rows)

    def layer_start(self, layer: int) -> None:
        """Called by the decoder-layer pre-hook (every forward; acts in a phase forward)."""
        if self.context is not None:
            for fn in self.context.before_layer:
                fn(layer)

    def layer_end(self, layer: int) -> None:
        """Called by the decoder-layer post-hook (every forward; acts in a phase forward)."""
        if self.context is not None:
            for fn in self.context.after_layer:
                fn(layer)

    def attention_end(
        self,
        layer: int,
        module: Any,
        q: torch.Tensor | None,  # [n, num_heads * head_dim]
    ) -> None:
        """Called after decoder layer ``layer``'s RadixAttention (every forward; acts in a
        phase forward)."""
        if self.context is not None:
            for fn in self.context.after_attention:
                fn(layer, module, q)
