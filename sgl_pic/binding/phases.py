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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from sgl_pic.binding.attention import AttnGroup, row_groups
from sgl_pic.binding.phase_batch import PhaseBatch, build_phase_batch
from sgl_pic.core.runs import SubRequest
from sgl_pic.engine.phase_port import AttentionFn, LayerFn, Stack

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
        model_runner: Any | None = None,  # SGLang's ModelRunner: its streams and WAR fence
    ) -> None:
        self.backend = backend
        self.model_runner = model_runner
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
        stack: Stack,
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
        """Gives ``rows`` back to SGLang's request table once nothing queued still reads
        them, without waiting on the host (``fence_reads``)."""
        if not rows or self.req_pool is None:
            return
        if self.req_to_token.is_cuda:
            fence_reads(self.model_runner, self.req_to_token.device)
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


def fence_reads(model_runner: Any | None, device: torch.device) -> None:
    """Orders SGLang's next writes to the request table after every kernel queued so far
    on this stream, with no host wait. SGLang's overlap scheduler prepares the next batch
    on its schedule stream while the forward stream may still run, and fences it after
    each forward (``Scheduler._apply_war_barrier``): on the runner's published read-done
    event, recorded after the live batch's metadata (before any phase kernel), or, when
    none is published, on the whole forward stream. Inside a forward this re-records that
    event here, after the phase kernels; outside one (the schedule stream) the current
    stream waits for the forward stream. Without both streams known: a stream sync."""
    current = torch.cuda.current_stream(device)
    forward = getattr(model_runner, "forward_stream", None)
    if forward is None:
        current.synchronize()
    elif current == forward:
        event = model_runner.shared_read_done_event
        if event is not None:
            event.record(current)
    else:
        current.wait_stream(forward)
