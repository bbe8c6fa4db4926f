"""Where the chunk path meets the model runner, for any SGLang causal LM.

``check_support`` decides at start-up whether the method covers the served model and the
selected attention backend; ``install`` then wraps the runner's decoder stack
(``model_runner.model.model``: the module that maps ids and positions to hidden states in
every SGLang causal LM) and puts pre/post hooks on its decoder layers. No model class is
patched: the wrapper is set on the one instance the runner serves, and it hands extend
batches with chunked requests to the executor, everything else to the stack unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sgl_pic.binding.model_rope import UnsupportedRope, find_rotary
from sgl_pic.binding.self_check import (
    NO_FLAG,
    SUPPORTED_BACKENDS,
    Support,
    check_args,
    check_model_config,
    sglang_kv_tiers,
)

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_BACKENDS", "Support", "check_support", "install", "sglang_kv_tiers"]

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# SGLang's prefill graph runner; batches with chunked requests are kept off it by
# ``hooks.prefill_graph_hook`` on its ``can_run_graph``.
PREFILL_GRAPH_RUNNER = "PrefillCudaGraphRunner"


def check_support(ctx: Any, prefill_graph_guarded: Callable[[Any], bool] | None = None) -> Support:
    """Whether the chunk path covers this server (``ctx``: SGLang's tree-cache build
    context). Models whose attention the method does not cover are refused here (what
    their config decides by ``self_check.check_model_config``, the launcher's rule too);
    every refusal's detail names the flag that would lift it.
    ``prefill_graph_guarded(runner)``: whether batches with chunked requests are kept off
    that prefill graph runner (default: the plugin's hook is on its ``can_run_graph``)."""
    guarded = prefill_graph_guarded or graph_guarded
    runner = getattr(getattr(ctx, "tp_worker", None), "model_runner", None)
    if runner is None:
        return Support("no_model_runner", "the scheduler exposes no model runner")
    hybrid = ctx.is_hybrid_swa or ctx.is_hybrid_ssm or getattr(ctx, "is_dsa", False)
    # The model first: no flag lifts its refusal, so naming one (the backend's) would mislead.
    for support in (check_model_config(ctx.model_config, hybrid), check_args(ctx.server_args)):
        if not support.ok:
            return support
    pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    if type(pool).__name__ != "MHATokenToKVPool":
        return Support(
            "kv_pool", f"KV pool {type(pool).__name__} (needs MHATokenToKVPool); {NO_FLAG}"
        )
    if pool.dtype not in KV_DTYPES:
        return Support(
            "kv_dtype",
            f"KV cache dtype {pool.dtype} (quantized KV is not covered); "
            "lifted by --kv-cache-dtype auto",
        )
    graph = getattr(runner, "prefill_cuda_graph_runner", None)
    graph_kind = type(graph).__name__
    if (
        graph is not None
        and graph_kind != "EagerRunner"
        and not (graph_kind == PREFILL_GRAPH_RUNNER and guarded(graph))
    ):
        return Support(
            "prefill_graph",
            f"prefill CUDA graph runner {graph_kind} without the chunk-batch guard on its "
            "can_run_graph; lifted by --cuda-graph-backend-prefill disabled",
        )
    stack = getattr(runner.model, "model", None)
    layers = getattr(stack, "layers", None)
    if not isinstance(stack, torch.nn.Module) or not isinstance(layers, torch.nn.ModuleList):
        return Support(
            "model", f"{type(runner.model).__name__} has no .model.layers stack; {NO_FLAG}"
        )
    for module in runner.model.modules():
        if type(module).__name__ != "RadixAttention":
            continue
        if getattr(module, "is_cross_attention", False):
            return Support("cross_attention", f"cross attention; {NO_FLAG}")
        if getattr(module, "sliding_window_size", -1) not in (None, -1):
            return Support("sliding_window", f"sliding-window attention; {NO_FLAG}")
    try:
        find_rotary(runner.model)
    except UnsupportedRope as e:
        return Support("rope", f"{e}; {NO_FLAG}")
    return Support("", "")


def graph_guarded(graph_runner: Any) -> bool:
    """Whether ``hooks.prefill_graph_hook`` wraps the ``can_run_graph`` this prefill
    graph runner's class resolves to (SGLang's HookRegistry applies it as an AROUND
    wrapper whose ``__wrapped__`` chain leads to the original)."""
    import inspect

    from sgl_pic.binding.hooks import prefill_graph_hook

    fn = getattr(type(graph_runner), "can_run_graph", None)
    while callable(fn):
        try:
            hooks = inspect.getclosurevars(fn).nonlocals.values()
        except TypeError:  # a builtin or C callable: no closure to read
            return False
        if any(h is prefill_graph_hook for h in hooks):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


StackForward = Callable[..., Any]
# Set on the wrapper function ``install`` puts on the stack (never on SGLang's objects): the
# stack's own forward it wraps.
WRAPPED = "__sgl_pic_wraps__"


def install(
    model_runner: Any,
    on_extend: Callable[[StackForward, torch.Tensor, torch.Tensor, Any], torch.Tensor | None],
    layer_start: Callable[[int], None],
    layer_end: Callable[[int], None],
    on_bypass: Callable[[Any], None] = lambda _fb: None,
    attention_end: Callable[[int, Any, torch.Tensor | None], None] = lambda _i, _m, _q: None,
    logits_end: Callable[[Any, Any], None] = lambda _md, _o: None,
) -> None:
    """Wraps the runner's decoder stack and hooks its layers.

    on_extend(stack, input_ids, positions, forward_batch): hidden states for an extend
    batch, or None to let the stack run it as SGLang would; ``stack(ids, pos, fb)`` is the
    stack's own forward. layer_start/layer_end(i) run around decoder layer i, and
    attention_end(i, module, q) after its RadixAttention (``q``: its post-RoPE queries
    # [n, num_heads * head_dim]); all must return quickly when no phase is running.
    on_bypass(fb): an extend batch the executor cannot take (input embeddings, pipeline
    tensors) runs as SGLang would. logits_end(metadata, output) after the model's logits
    processor (``model_runner.model.logits_processor``, where the model has one) with its
    ForwardBatch or LogitsMetadata and its LogitsProcessorOutput, on every forward."""
    stack = model_runner.model.model
    if getattr(stack.forward, WRAPPED, None) is not None:
        return  # installed already: the wrapper (our function) names what it wraps
    stack.forward = _wrapped_forward(stack.forward, on_extend, on_bypass)
    processor = getattr(model_runner.model, "logits_processor", None)
    if isinstance(processor, torch.nn.Module):
        processor.register_forward_hook(
            lambda _m, a, kw, out: logits_end(_logits_metadata(a, kw), out), with_kwargs=True
        )
    _hook_layers(stack.layers, layer_start, layer_end, attention_end)


def _wrapped_forward(
    original: StackForward,
    on_extend: Callable[[StackForward, torch.Tensor, torch.Tensor, Any], torch.Tensor | None],
    on_bypass: Callable[[Any], None],
) -> StackForward:
    """The forward ``install`` sets on the decoder stack in place of ``original`` (named
    by its ``WRAPPED`` attribute): extend batches with no extra inputs go to
    ``on_extend``, extend batches with extras to ``on_bypass`` and then ``original``,
    everything else (and extends ``on_extend`` declines) to ``original`` unchanged."""

    def forward(
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        forward_batch: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        extras = [a for a in args if a is not None] + [v for v in kwargs.values() if v is not None]
        if not forward_batch.forward_mode.is_extend():
            return original(input_ids, positions, forward_batch, *args, **kwargs)
        if extras:
            on_bypass(forward_batch)
            return original(input_ids, positions, forward_batch, *args, **kwargs)

        def run(ids: torch.Tensor, pos: torch.Tensor, fb: Any) -> torch.Tensor:
            return original(ids, pos, fb)

        hidden = on_extend(run, input_ids, positions, forward_batch)
        if hidden is None:
            return original(input_ids, positions, forward_batch, *args, **kwargs)
        return hidden

    setattr(forward, WRAPPED, original)
    return forward


def _hook_layers(
    layers: torch.nn.ModuleList,
    layer_start: Callable[[int], None],
    layer_end: Callable[[int], None],
    attention_end: Callable[[int, Any, torch.Tensor | None], None],
) -> None:
    """Puts ``install``'s hooks on the decoder layers: layer_start/layer_end(i) around
    layer i, attention_end(i, module, q) after each of its RadixAttention modules."""
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: layer_start(i))
        layer.register_forward_hook(lambda _m, _a, _o, i=i: layer_end(i))
        for attn in radix_attentions(layer):
            attn.register_forward_hook(
                # .get: a call without q must not fail here, outside any phase.
                lambda m, a, kw, _o, i=i: attention_end(i, m, a[0] if a else kw.get("q")),
                with_kwargs=True,
            )


def radix_attentions(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The RadixAttention modules of one decoder layer (one in every covered model)."""
    return [m for m in layer.modules() if type(m).__name__ == "RadixAttention"]


def _logits_metadata(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ForwardBatch or LogitsMetadata of a ``LogitsProcessor.forward`` call
    (input_ids, hidden_states, lm_head, logits_metadata, ...), passed either way."""
    return args[3] if len(args) > 3 else kwargs.get("logits_metadata")
