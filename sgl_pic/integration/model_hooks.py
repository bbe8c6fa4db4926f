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
from typing import Any, NamedTuple

import torch

from sgl_pic.integration.model_rope import UnsupportedRope, find_rotary

logger = logging.getLogger(__name__)

# Backends whose extend reads keys through req_to_token rows with per-sequence prefix
# lengths, which is all a phase batch is.
SUPPORTED_BACKENDS = frozenset({"torch_native", "flashinfer", "fa3", "triton"})
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Support(NamedTuple):
    """``reason`` is a metric label (one word) and ``detail`` the log line's text; both
    empty when the chunk path can serve the model."""

    reason: str
    detail: str

    @property
    def ok(self) -> bool:
        return not self.reason


def check_support(ctx: Any) -> Support:
    """Whether the chunk path covers this server (``ctx``: SGLang's tree-cache build
    context). Models whose attention the method does not cover are refused here."""
    args = ctx.server_args
    runner = getattr(getattr(ctx, "tp_worker", None), "model_runner", None)
    if runner is None:
        return Support("no_model_runner", "the scheduler exposes no model runner")
    backends = {
        getattr(args, "attention_backend", None),
        getattr(args, "prefill_attention_backend", None),
    } - {None}
    if not backends <= SUPPORTED_BACKENDS:
        return Support(
            "backend",
            f"attention backend {sorted(backends)} is not one of {sorted(SUPPORTED_BACKENDS)}",
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or getattr(ctx, "is_dsa", False):
        return Support("hybrid", "hybrid sliding-window / state-space / sparse attention models")
    hf = ctx.model_config.hf_config
    if getattr(hf, "kv_lora_rank", None):
        return Support("mla", "multi-head latent attention (MLA)")
    if int(getattr(args, "pp_size", 1) or 1) > 1 or getattr(args, "enable_dp_attention", False):
        return Support("parallelism", "pipeline parallelism or DP attention")
    if getattr(args, "speculative_algorithm", None):
        return Support("speculative", "speculative decoding")
    if getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None):
        # LoRA layers read batch info prepared for the live batch's segments.
        return Support("lora", "LoRA adapters")
    if getattr(args, "enable_two_batch_overlap", False):
        return Support("parallelism", "two-batch overlap")
    if int(getattr(args, "attn_cp_size", 1) or 1) > 1:
        return Support("parallelism", "context parallelism")
    tiers = sglang_kv_tiers(args)
    if tiers:
        return Support("kv_tiers", f"SGLang's own KV tiers or connectors ({', '.join(tiers)})")
    if str(getattr(args, "disaggregation_mode", "null") or "null") != "null":
        return Support("disaggregation", "prefill-decode disaggregation")
    pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    if type(pool).__name__ != "MHATokenToKVPool":
        return Support("kv_pool", f"KV pool {type(pool).__name__} (needs MHATokenToKVPool)")
    if pool.dtype not in KV_DTYPES:
        return Support("kv_dtype", f"KV cache dtype {pool.dtype} (quantized KV is not covered)")
    prefill_graph = getattr(runner, "prefill_cuda_graph_runner", None)
    if prefill_graph is not None and type(prefill_graph).__name__ != "EagerRunner":
        return Support("prefill_graph", "piecewise prefill CUDA graphs (decode graphs are fine)")
    stack = getattr(runner.model, "model", None)
    layers = getattr(stack, "layers", None)
    if not isinstance(stack, torch.nn.Module) or not isinstance(layers, torch.nn.ModuleList):
        return Support("model", f"{type(runner.model).__name__} has no .model.layers stack")
    for module in runner.model.modules():
        if type(module).__name__ != "RadixAttention":
            continue
        if getattr(module, "is_cross_attention", False):
            return Support("cross_attention", "cross attention")
        if getattr(module, "sliding_window_size", -1) not in (None, -1):
            return Support("sliding_window", "sliding-window attention")
    try:
        find_rotary(runner.model)
    except UnsupportedRope as e:
        return Support("rope", str(e))
    return Support("", "")


def sglang_kv_tiers(args: Any) -> list[str]:
    """The SGLang flags that put its own KV tiers or connectors under the radix tree.
    Chunk reuse is not combined with them: they have not run together (SGLang's
    HiCache does not run on the CPU at all), HiCache would write approximate KV to its
    host and storage tiers, and LMCache or FlexKV would be dropped without a word, since
    the sgl_pic tree takes the radix-cache factory they are built by."""
    on = [
        flag
        for flag in (
            "enable_hierarchical_cache",
            "enable_lmcache",
            "enable_flexkv",
            "enable_unified_cache_external_linker",
        )
        if getattr(args, flag, False)
    ]
    if getattr(args, "disaggregation_decode_retraction_backup", None) == "host_pool":
        on.append("disaggregation_decode_retraction_backup=host_pool")
    return ["--" + f.replace("_", "-") for f in on]


StackForward = Callable[..., Any]


def install(
    model_runner: Any,
    on_extend: Callable[[StackForward, torch.Tensor, torch.Tensor, Any], torch.Tensor | None],
    layer_start: Callable[[int], None],
    layer_end: Callable[[int], None],
    on_bypass: Callable[[Any], None] = lambda _fb: None,
    attention_end: Callable[[int, Any, torch.Tensor | None], None] = lambda _i, _m, _q: None,
) -> None:
    """Wraps the runner's decoder stack and hooks its layers.

    on_extend(stack, input_ids, positions, forward_batch): hidden states for an extend
    batch, or None to let the stack run it as SGLang would; ``stack(ids, pos, fb)`` is the
    stack's own forward. layer_start/layer_end(i) run around decoder layer i, and
    attention_end(i, module, q) after its RadixAttention (``q``: its post-RoPE queries
    # [n, num_heads * head_dim]); all must return quickly when no phase is running.
    on_bypass(fb): an extend batch the executor cannot take (input embeddings, pipeline
    tensors) runs as SGLang would."""
    stack = model_runner.model.model
    if getattr(stack, "_sgl_pic_wrapped", False):
        return
    original = stack.forward

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

    stack.forward = forward
    stack._sgl_pic_wrapped = True
    for i, layer in enumerate(stack.layers):
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
