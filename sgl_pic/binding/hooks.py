"""The functions SGLang's HookRegistry calls (``plugin.register`` registers them).

Each is a thin entry point: it finds this process's ``PicRuntime`` (``runtime.current``)
and calls the runtime's method for its side, or passes straight through to SGLang when no
runtime was built here, so installing the plugin never changes a server that does not
select the ``sgl_pic`` backend.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_pic.binding.runtime import current

# torch_native's extend, for phase batches only (``attention.torch_native_phase_extend``).
TORCH_NATIVE_EXTEND = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
)
PREPARE_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
# Called by the scheduler on every generate request before it is queued (the patch
# reaches the scheduler's own ``from ... import`` binding through HookRegistry).
ADMIT_TARGET = "sglang.srt.managers.utils.validate_input_length"
# Asked by ``ModelRunner._forward_raw`` of every extend batch before it replays a prefill
# CUDA graph (SGLang 0.5.23 captures breakable ones by default on CUDA).
# The scheduler's factory of the ``PrefillAdder`` it forms each prefill batch with.
PREFILL_ADDER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class"
PREFILL_GRAPH_TARGET = (
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner."
    "PrefillCudaGraphRunner.can_run_graph"
)


def admit_hook(original: Any, req: Any, *args: Any, **kwargs: Any) -> str | None:
    """Scheduler side. AROUND ``validate_input_length``: SGLang's own input checks first;
    then, on a request SGLang accepts, the runtime's gate."""
    error = original(req, *args, **kwargs)
    runtime = current()
    if error is not None or runtime is None:
        return error
    return runtime.admit(req)


def after_prepare_for_extend(result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Scheduler side. AFTER ``ScheduleBatch.prepare_for_extend``: the batch's chunked
    requests become the hand-off of its forward (``PicRuntime.prepare_batch``)."""
    runtime = current()
    if runtime is not None:
        runtime.prepare_batch(batch)
    return result


def torch_native_extend_hook(
    original: Any,
    backend: Any,
    q: torch.Tensor,  # [n, num_heads * head_dim]
    k: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
    v: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
    layer: Any,
    forward_batch: Any,
    save_kv_cache: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """Worker side. AROUND ``TorchNativeAttnBackend.forward_extend``: SGLang's own path for
    every batch but a phase batch of this process's runtime."""
    runtime = current()
    if runtime is None or not runtime.runs_phase(forward_batch):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return runtime.torch_native_extend(backend, q, k, v, layer, forward_batch, save_kv_cache)


def prefill_graph_hook(
    original: Any, graph_runner: Any, forward_batch: Any, *a: Any, **kw: Any
) -> bool:
    """Worker side. AROUND ``PrefillCudaGraphRunner.can_run_graph``: a batch carrying
    chunked requests of this process's runtime runs eagerly, where the decoder-stack
    wrapper hands it to the executor (``PicRuntime.keeps_off_prefill_graph``); every other
    batch is SGLang's decision. The eager path is the one SGLang itself takes for batches
    its graphs cannot run, on the same attention backend, which every replay plans
    afresh."""
    runtime = current()
    if runtime is not None and runtime.keeps_off_prefill_graph(forward_batch):
        return False
    return original(graph_runner, forward_batch, *a, **kw)


class PrefillAdderFactory:
    """Scheduler side. ``hook`` is the AROUND hook on ``Scheduler.get_prefill_adder_class``
    (the registry holds the instance): with reuse on in this process, the scheduler builds
    the adder that charges chunked requests their planned cost
    (``cost_adder.PlannedCostAdder``), else (and with tensor parallelism) SGLang's. It
    keeps the runtime's ``PlannedCharges`` from pass to pass, so what an estimate computes
    of a waiting request is not computed again at every pass."""

    def __init__(self) -> None:
        self._runtime: Any = None
        self._charges: Any = None

    def hook(self, original: Any, scheduler: Any, *a: Any, **kw: Any) -> Any:
        """Scheduler side, once per prefill batch SGLang forms: the adder to form it with."""
        base = original(scheduler, *a, **kw)
        runtime = current()
        if runtime is None or runtime.executor is None or runtime.executor.ranks.shared:
            # With tensor parallelism each rank's estimate reads its own tiers, which may
            # differ; SGLang's schedulers must form the same batches on every rank.
            return base
        from sgl_pic.binding.cost_adder import adder_factory, planned_charges

        if runtime is not self._runtime:
            self._runtime, self._charges = runtime, planned_charges(runtime)
        return adder_factory(base, self._charges)
