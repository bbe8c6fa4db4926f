"""What the chunk path needs of SGLang's resolved server arguments and of the model's
config (``check_model_config``), and which flag lifts each refusal.

SGLang 0.5.23 resolves its arguments into a stash of declarations beside the raw record
(``ServerArgs.resolve_once``; ``arg_groups.model_override_base.resolved_view`` reads
through it): a default launch leaves ``attention_backend``, ``page_size`` and the CUDA
graph config unset on the record itself. Every check here reads the resolved view, so the
launcher (before the model loads) and the scheduler (``model_hooks.check_support``, at
tree-cache build) decide on the values SGLang actually serves with.

Pure functions of their arguments; they change nothing.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

# Backends whose extend reads keys through req_to_token rows with per-sequence prefix
# lengths, which is all a phase batch is.
SUPPORTED_BACKENDS = frozenset({"torch_native", "flashinfer", "fa3", "triton"})
# Prefill CUDA graph backends the chunk path runs beside: batches with chunked requests
# are kept off the graph (``hooks.prefill_graph_hook``) and run eagerly.
PREFILL_GRAPH_BACKENDS = frozenset({"disabled", "breakable", "full"})
# --kv-cache-dtype values SGLang maps to an unquantized pool (srt/mem_cache/kv_cache_dtype.py).
KV_CACHE_DTYPES = frozenset({"auto", "float32", "float16", "bfloat16", "bf16"})
NO_FLAG = "a property of the model: no server flag lifts it (--pic-disable serves it plainly)"


class Support(NamedTuple):
    """``reason`` is a metric label (one word) and ``detail`` the log line's text, naming
    the flag that would lift the refusal; both empty when the chunk path can serve."""

    reason: str
    detail: str

    @property
    def ok(self) -> bool:
        return not self.reason


OK = Support("", "")


def resolved(args: Any) -> Any:
    """``args`` as SGLang resolved it (its declarations over the raw fields); a record
    without declarations (not yet resolved, or a stand-in) reads as it is."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    return resolved_view(args)


def attention_backends(view: Any) -> tuple[str | None, str | None]:
    """(prefill, decode) backend of a resolved view; a split field falls back to
    ``attention_backend`` as SGLang's ``attention_backends_of`` does."""
    base = getattr(view, "attention_backend", None)
    prefill = getattr(view, "prefill_attention_backend", None) or base
    decode = getattr(view, "decode_attention_backend", None) or base
    return prefill, decode


def check_model_config(model_config: Any, hybrid: bool = False) -> Support:
    """The part of the support check SGLang's ``ModelConfig`` decides before the model
    loads, written once for the launcher (which keeps SGLang's attention backend for a
    model refused here) and the scheduler (``model_hooks.check_support``): hybrid
    attention (``hybrid_attention``), multi-head latent attention and encoder-decoder
    (cross attention) models. ``hybrid``: what the caller knows besides (the scheduler's
    build-context flags ``is_hybrid_swa`` / ``is_hybrid_ssm`` / ``is_dsa``). A stand-in
    (no SGLang ModelConfig) is read by the fields it carries."""
    if hybrid or hybrid_attention(model_config):
        return Support(
            "hybrid", f"hybrid sliding-window / state-space / sparse attention models; {NO_FLAG}"
        )
    arch = getattr(getattr(model_config, "attention_arch", None), "name", None)
    if arch == "MLA" or getattr(getattr(model_config, "hf_config", None), "kv_lora_rank", None):
        return Support("mla", f"multi-head latent attention (MLA); {NO_FLAG}")
    if getattr(model_config, "is_encoder_decoder", False):
        return Support("cross_attention", f"cross attention; {NO_FLAG}")
    return OK


def hybrid_attention(model_config: Any) -> bool:
    """Whether SGLang serves the model with hybrid sliding-window, state-space or sparse
    (DSA) attention, from the sources its scheduler reads (``kv_cache_builder.build_kv_cache``:
    ``ModelConfig.is_hybrid_swa``, ``uses_ssm_state``, ``is_deepseek_dsa``), plus the
    architecture's own SWA verdict (``is_hybrid_swa_model``: under
    ``--disable-hybrid-swa-memory`` its sliding layers keep their window) and pure
    state-space models (``AttentionArch.SSM``). A stand-in: its ``is_hybrid_swa`` only."""
    if getattr(model_config, "is_hybrid_swa", False):
        return True
    module = sys.modules.get("sglang.srt.configs.model_config")  # loaded with any instance
    if module is None or not isinstance(model_config, module.ModelConfig):
        return False
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    hf = model_config.hf_config
    return bool(
        module.is_hybrid_swa_model(hf.architectures or [], model_config.hf_text_config)
        or model_config.attention_arch == module.AttentionArch.SSM
        or module.is_deepseek_dsa(hf)
        or uses_ssm_state(model_config)
    )


def check_args(args: Any) -> Support:
    """The server-argument part of the support check, on the resolved values: the first
    refusal of ``check_backends``, ``check_parallelism``, ``check_expert_parallel``,
    ``check_features`` and ``check_kv``, or ``OK``."""
    v = resolved(args)
    for check in (
        check_backends,
        check_parallelism,
        check_expert_parallel,
        check_features,
        check_kv,
    ):
        support = check(v)
        if not support.ok:
            return support
    return OK


def check_backends(v: Any) -> Support:
    """The prefill and decode attention backends of the resolved view ``v``."""
    prefill, decode = attention_backends(v)
    for flag, backend in (
        ("--prefill-attention-backend", prefill),
        ("--decode-attention-backend", decode),
    ):
        if backend is not None and backend not in SUPPORTED_BACKENDS:
            return Support(
                "backend",
                f"attention backend {backend!r} is not one of {sorted(SUPPORTED_BACKENDS)}; "
                f"lifted by --attention-backend (or {flag}) "
                f"{'|'.join(sorted(SUPPORTED_BACKENDS))}",
            )
    return OK


def check_parallelism(v: Any) -> Support:
    """Pipeline, attention-DP, two-batch-overlap, context and PD-multiplexed parallelism
    of the resolved view ``v``. SGLang 0.5.23 resolves the deprecated
    ``--dp-size N --enable-dp-attention`` (and ``--dwdp-size N``) into ``attn_dp_size``
    and leaves ``enable_dp_attention`` false, so DP attention is read from the widths
    (DWDP's too, for a record not yet resolved)."""
    if int(getattr(v, "pp_size", 1) or 1) > 1:
        return Support("parallelism", "pipeline parallelism; lifted by --pp-size 1")
    widths = (int(getattr(v, f, 1) or 1) for f in ("attn_dp_size", "dwdp_size"))
    if max(widths) > 1 or getattr(v, "enable_dp_attention", False):
        return Support(
            "parallelism",
            "DP attention; lifted by --attn-dp-size 1, dropping --enable-dp-attention and "
            "--dwdp-size (which resolve into it)",
        )
    if getattr(v, "enable_two_batch_overlap", False):
        return Support(
            "parallelism", "two-batch overlap; lifted by dropping --enable-two-batch-overlap"
        )
    if int(getattr(v, "attn_cp_size", 1) or 1) > 1:
        return Support("parallelism", "context parallelism; lifted by --attn-cp-size 1")
    if getattr(v, "enable_pdmux", False):
        # PD-multiplexing prefills layer by layer (``forward_split_prefill``) and never
        # calls the decoder stack the chunk path wraps.
        return Support("parallelism", "PD-multiplexing; lifted by dropping --enable-pdmux")
    return OK


def expert_parallel_lifts(v: Any) -> list[str]:
    """What lifts each SGLang setting of the resolved view ``v`` under which its MoE
    top-k masks routed rows by the live batch's token count (SGLang's
    ``enable_num_token_non_padded``: EP width above one, a non-``none`` all-to-all
    backend, which resolution widens EP to the TP size for, Waterfill, which resolution
    turns into the DeepEP backend, and elastic EP); empty for SGLang's TP-only MoE."""
    lifts = []
    a2a = str(getattr(v, "moe_a2a_backend", "none") or "none")
    if a2a != "none":
        lifts.append(f"--moe-a2a-backend none (not {a2a})")
    if int(getattr(v, "ep_size", 1) or 1) > 1:
        lifts.append("--ep-size 1")
    if getattr(v, "enable_waterfill", False):
        lifts.append("dropping --enable-waterfill")
    for field, flag in (
        ("elastic_ep_backend", "--elastic-ep-backend"),
        ("ep_join_mode", "--elastic-ep-join-mode"),
    ):
        if str(getattr(v, field, None) or "none") != "none":
            lifts.append(f"dropping {flag}")
    return lifts


def check_expert_parallel(v: Any) -> Support:
    """MoE expert parallelism and all-to-all of the resolved view ``v``. A phase batch
    runs inside the live batch's forward context, whose MoE top-k (SGLang's
    ``resolve_routing_inputs``) masks every row past the live batch's token count: a
    phase batch larger than the live one would lose its experts there."""
    lifts = expert_parallel_lifts(v)
    if not lifts:
        return OK
    return Support(
        "expert_parallel",
        "MoE expert parallelism or all-to-all (its top-k masks rows past the live "
        f"batch's token count); lifted by {', '.join(lifts)}",
    )


def check_features(v: Any) -> Support:
    """Speculative decoding, LoRA and diffusion LMs of the resolved view ``v``."""
    if getattr(v, "speculative_algorithm", None):
        return Support(
            "speculative", "speculative decoding; lifted by dropping --speculative-algorithm"
        )
    if getattr(v, "enable_lora", False) or getattr(v, "lora_paths", None):
        # LoRA layers read batch info prepared for the live batch's segments.
        return Support("lora", "LoRA adapters; lifted by dropping --enable-lora / --lora-paths")
    if getattr(v, "dllm_algorithm", None):
        # A diffusion LM's prefills and denoising steps are DLLM_EXTEND batches, which
        # the chunk path (a causal extend) does not model.
        return Support(
            "dllm", "diffusion LM (DLLM_EXTEND batches); lifted by dropping --dllm-algorithm"
        )
    return OK


def check_kv(v: Any) -> Support:
    """SGLang's own KV tiers, PD disaggregation, the KV cache dtype and the prefill CUDA
    graph backend of the resolved view ``v``."""
    tiers = sglang_kv_tiers(v)
    if tiers:
        return Support(
            "kv_tiers",
            f"SGLang's own KV tiers or connectors ({', '.join(tiers)}); lifted by dropping "
            f"{' and '.join(t.split('=')[0] for t in tiers)}",
        )
    if str(getattr(v, "disaggregation_mode", "null") or "null") != "null":
        return Support(
            "disaggregation", "prefill-decode disaggregation; lifted by --disaggregation-mode null"
        )
    kv_dtype = str(getattr(v, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype not in KV_CACHE_DTYPES:
        return Support(
            "kv_dtype",
            f"KV cache dtype {kv_dtype} (quantized KV is not covered); "
            "lifted by --kv-cache-dtype auto",
        )
    graphs = getattr(v, "cuda_graph_config", None)
    prefill_graph = getattr(getattr(graphs, "prefill", None), "backend", None)
    if prefill_graph is not None and prefill_graph not in PREFILL_GRAPH_BACKENDS:
        return Support(
            "prefill_graph",
            f"prefill CUDA graph backend {prefill_graph!r}; "
            "lifted by --cuda-graph-backend-prefill disabled",
        )
    return OK


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


def pool_page_size(ctx: Any) -> int:
    """The page size of the KV allocator SGLang built (``ctx``: its tree-cache build
    context); every allocator and ``CacheInitParams`` carry ``page_size``."""
    allocator = ctx.params.token_to_kv_pool_allocator
    return int(getattr(allocator, "page_size", None) or getattr(ctx.params, "page_size", 1) or 1)


def check_page_size(configured: int, ctx: Any) -> Support:
    """Chunk starts are padded to ``configured`` (the launcher's page size) by the HTTP
    side; the pool pages at its own size. They must agree, or phase-1 scratch rows and
    stored chunks would straddle pages the backend reads page-strided."""
    pool = pool_page_size(ctx)
    tree = int(getattr(ctx.params, "page_size", pool) or pool)
    if configured == pool == tree:
        return OK
    return Support(
        "page_size",
        f"chunk starts are padded to page size {configured} but the KV pool pages at {pool} "
        f"(tree {tree}); lifted by --page-size {pool}",
    )


def check_launch(args: Any, page_size: int) -> Support:
    """The launch-time self-check: ``check_args`` on the resolved arguments, and the page
    size chunk starts are padded to (``page_size``) against the resolved one."""
    support = check_args(args)
    if not support.ok:
        return support
    resolved_page = int(getattr(resolved(args), "page_size", None) or 1)
    if resolved_page != page_size:
        return Support(
            "page_size",
            f"chunk starts are padded to page size {page_size} but SGLang resolved "
            f"--page-size {resolved_page}; lifted by --page-size {resolved_page}",
        )
    return OK
