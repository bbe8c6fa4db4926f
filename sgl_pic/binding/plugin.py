"""Registration with SGLang: the ``sgl_pic`` radix cache backend and the targeted hooks.

``register`` is the ``sglang.srt.plugins`` entry point; SGLang's ``load_plugins()`` calls it
in every process (scheduler included) and then applies the hooks. It is idempotent, so
``python -m sgl_pic.launch_server`` may also call it where no entry point is installed.

``build_tree_cache`` (the backend's factory) builds this scheduler process's
``PicRuntime``, the one owner of its state; the hooks (``binding.hooks``) pass straight
through to SGLang unless it was built in that process, so installing the plugin never
changes a server that does not select it. One hook only reads the clock, in every server
(``forward_timer``: seconds in forwards by kind); one adds the drift signal to OpenAI chat
responses (``http.openai_meta``), only where this backend's scheduler put it in
``meta_info``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from sgl_pic.binding import hooks
from sgl_pic.binding.fingerprint import machine_digests
from sgl_pic.binding.forward_timer import FORWARD_TARGET, ForwardTimer
from sgl_pic.binding.settings import BACKEND_NAME
from sgl_pic.binding.weight_updates import WeightUpdateHook
from sgl_pic.http import openai_meta

logger = logging.getLogger(__name__)


def register() -> None:
    """Registers the backend and the hooks, once per process: a second call finds the
    backend registered and does nothing."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if get_radix_cache_factory(BACKEND_NAME) is not None:
        return
    register_radix_cache_backend(BACKEND_NAME, build_tree_cache)
    HookRegistry.register(
        hooks.TORCH_NATIVE_EXTEND, hooks.torch_native_extend_hook, HookType.AROUND
    )
    HookRegistry.register(hooks.PREPARE_TARGET, hooks.after_prepare_for_extend, HookType.AFTER)
    HookRegistry.register(hooks.ADMIT_TARGET, hooks.admit_hook, HookType.AROUND)
    # The registry holds the timer (and through it its counters): no module state.
    HookRegistry.register(FORWARD_TARGET, ForwardTimer().timed_forward, HookType.AROUND)
    HookRegistry.register(hooks.PREFILL_GRAPH_TARGET, hooks.prefill_graph_hook, HookType.AROUND)
    # The registry holds the factory (and through it the planned charges): no module state.
    HookRegistry.register(
        hooks.PREFILL_ADDER_TARGET, hooks.PrefillAdderFactory().hook, HookType.AROUND
    )
    HookRegistry.register(openai_meta.CHAT_TARGET, openai_meta.after_build_response, HookType.AFTER)
    # The registry holds the hook (and through it the digest cache): no module state.
    for target, hook in WeightUpdateHook(machine_digests()).targets().items():
        HookRegistry.register(target, hook, HookType.AFTER)


def build_tree_cache(ctx: Any) -> Any:
    """Radix cache factory: SGLang's own tree plus chunk nodes (``ChunkRadixCache``), the
    host and disk tiers under them, the executor that uses them, and the process's
    ``PicRuntime`` that owns them (``runtime.set_current``)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_pic.binding import radix_cache
    from sgl_pic.binding.drift_signal import DriftSignal
    from sgl_pic.binding.fingerprint import server_fingerprint
    from sgl_pic.binding.gate import AdmissionGate, AdmittedMarks, restamped
    from sgl_pic.binding.metrics import PicMetrics
    from sgl_pic.binding.model_hooks import Support, check_support, install
    from sgl_pic.binding.model_rope import ModelRope, find_rotary, rope_spec
    from sgl_pic.binding.phases import PhaseRunner
    from sgl_pic.binding.runtime import PicRuntime, set_current
    from sgl_pic.binding.self_check import check_page_size
    from sgl_pic.binding.settings import PicServerSettings
    from sgl_pic.engine.chunk_nodes import ChunkNodeTable
    from sgl_pic.engine.deleter import Deleter
    from sgl_pic.engine.executor import ChunkExecutor
    from sgl_pic.engine.forwards import HiddenSpec
    from sgl_pic.engine.kv_access import KVAccess
    from sgl_pic.engine.rank_agreement import RankAgreement
    from sgl_pic.engine.tenants import tenant_policy
    from sgl_pic.http.spans import MarkSigner
    from sgl_pic.model_identity import ModelIdentityError
    from sgl_pic.selection import ranking_recipe
    from sgl_pic.store.admission import StoreAdmission

    settings = PicServerSettings.from_env()
    vocab_size = int(ctx.model_config.vocab_size)
    metrics = PicMetrics()
    marks = AdmittedMarks()
    # Checked before anything is built: a model or backend the method does not cover is
    # served exactly, with reuse off, a log line and a metric.
    support = check_support(ctx)
    if support.ok:
        # The HTTP side pads chunk starts to the launcher's page size; the pool pages at
        # the size SGLang resolved and built.
        support = check_page_size(settings.config.page_size, ctx)
    if support.ok and settings.refused:
        support = Support("model_check", f"{settings.refused}; lifted by dropping --pic-check")
    cache_pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    if support.ok:
        try:
            # Every chunk is stored with a ranking made at the server's alpha (a setting
            # no request can override), so the alpha is part of every key.
            fingerprint = dataclasses.replace(
                server_fingerprint(ctx, cache_pool.dtype, digests=machine_digests()),
                ranking=ranking_recipe(settings.config.cachetune_alpha),
            )
        except ModelIdentityError as e:
            support = Support(
                "model_identity", f"the weights have no identity to key chunks by ({e})"
            )
    if not support.ok:
        logger.error(
            "sgl_pic: chunk reuse is off (%s): %s; every request runs as exact prefill "
            "(see the README's list of covered models and backends)",
            support.reason,
            support.detail,
        )
        metrics.unsupported.labels(reason=support.reason).set(1)
        gate = AdmissionGate(settings.config, None, vocab_size, metrics, marks=marks)
        set_current(PicRuntime(gate, metrics))
        # SGLang's own tree, built as it would build it: its tiers, connectors and
        # model-specific caches then work as without sgl_pic.
        from sglang.srt.mem_cache.registry import default_radix_cache_factory

        return default_radix_cache_factory(ctx)
    metrics.enable_namespaces(settings.namespace_metrics)
    prepare_kernels(cache_pool.get_key_buffer(0).device)
    pool_tokens = int(ctx.params.token_to_kv_pool_allocator.size)
    capacity = int(settings.device_cache_fraction * pool_tokens)

    def make_table(allocator: Any) -> ChunkNodeTable:
        return ChunkNodeTable(
            allocator,
            fingerprint,
            settings.config.segment_tokens,
            capacity,
            settings.eviction,
            settings.namespace_max_tokens(capacity),
        )

    # Marks of requests SGLang ends (finished or aborted) are dropped by the cache.
    cache = radix_cache.build(ctx, make_table, metrics.node_tokens.set, marks.drop)
    assert cache.chunk_nodes is not None
    runner = ctx.tp_worker.model_runner
    hf = ctx.model_config.hf_config
    num_layers = int(hf.num_hidden_layers)
    spec = rope_spec(find_rotary(runner.model), cache_pool.get_key_buffer(0).device)
    kv = KVAccess(cache_pool, num_layers, ModelRope(spec))
    lower = shutdown = None
    if settings.has_lower_tiers and spec.inv_freq is None:
        logger.error(
            "sgl_pic: host and disk tiers are off: they store keys by plain RoPE frequencies, "
            "and this model's rotary table (partial rotary, attention scaling, or a table that "
            "is not one set of RoPE frequencies) has none"
        )
    elif settings.has_lower_tiers:
        lower, shutdown = _lower_tiers(settings, fingerprint, spec, metrics, record_layout(kv))
    ratios = None
    if settings.calibrate and lower is not None:
        ratios = calibrate_for_server(settings, hf, cache_pool, ctx)
        for tier, r in ratios.items():
            metrics.calibrated_r.labels(tier=tier).set(r)
    if not settings.secret:
        logger.error(
            "sgl_pic: no mark-signing secret (not started by python -m sgl_pic.launch_server); "
            "chunk marks are not honoured and every request runs as exact prefill"
        )
    phases = PhaseRunner(
        runner.attn_backend,
        ctx.params.req_to_token_pool.req_to_token,
        getattr(runner, "kv_index_translator", None),
        ctx.params.req_to_token_pool,
        runner,
    )
    deleter = Deleter(cache.chunk_nodes, cache, lower.store if lower is not None else None, metrics)
    # A request admitted before a deletion and matched after it moves to the fresh tree
    # namespace then, not only when admitted.
    cache.set_restamp(lambda extra_key: restamped(extra_key, deleter.generation))
    tp = int(getattr(ctx, "tp_size", 1) or 1) > 1
    executor = ChunkExecutor(
        settings.config,
        cache.chunk_nodes,
        kv,
        metrics,
        phases,
        lower=lower,
        ratios=ratios,
        feed_mode=settings.feed_mode,
        feed_timeout_s=settings.feed_timeout_s,
        merge_gap=settings.merge_gap,
        read_cap=settings.read_cap(ctx.model_config, int(getattr(ctx, "tp_size", 1) or 1)),
        admission=StoreAdmission(settings.admission),
        reduce=_tp_sum if tp else None,
        sync_deletions=deleter.sync if lower is not None else None,
        hidden=HiddenSpec(int(hf.hidden_size), runner.dtype),
        ranks=RankAgreement(_tp_max if tp else None),
        # SGLang's prefix tree is evicted from here on one rank only: with tensor
        # parallelism, where every rank's tree must stay alike, chunk nodes alone.
        make_room=None
        if tp
        else lambda n: int(cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted),
    )
    signer = MarkSigner(settings.secret) if settings.secret else None
    gate = AdmissionGate(
        settings.config,
        signer,
        vocab_size,
        metrics,
        ratios is not None,
        tenant_policy(settings),
        deleter,
        marks,
    )
    runtime = PicRuntime(
        gate, metrics, executor, phases, DriftSignal(metrics.first_token_entropy.observe)
    )
    cache.set_split_requests(
        runtime.request_done,
        lambda: executor.split.plans.held_tokens,
        executor.split.plans.forget_all,
    )
    if shutdown is not None:
        # The promoter reads from the tiers: its worker is joined before they stop.
        shutdown.before.append(runtime.close)
    install(
        runner,
        runtime.on_extend,
        phases.layer_start,
        phases.layer_end,
        runtime.on_bypass,
        phases.attention_end,
        runtime.on_logits,
    )
    if (
        type(getattr(runner, "prefill_cuda_graph_runner", None)).__name__
        == "PrefillCudaGraphRunner"
    ):
        logger.info(
            "sgl_pic: SGLang's prefill CUDA graphs stay on for batches without chunked "
            "requests; batches with chunked requests run eagerly"
        )
    set_current(runtime)
    logger.info(
        "sgl_pic chunk cache ready: policy=%s, model %s, attention backend %s, chunk nodes up "
        "to %d of %d pool slots, host tier %d MiB, disk tier %s, %d layers, rotary dim %d (%s)",
        settings.config.policy,
        type(runner.model).__name__,
        type(runner.attn_backend).__name__,
        capacity,
        pool_tokens,
        settings.host_cache_mb if lower is not None else 0,
        f"{settings.disk_cache_dir} ({settings.disk_cache_mb} MiB)"
        if settings.disk_cache_dir and lower is not None
        else "off",
        num_layers,
        spec.rotary_dim,
        spec.layout,
    )
    return cache


def prepare_kernels(device: torch.device) -> Any:
    """Builds or loads the CUDA kernels once, at start-up on the scheduler, for a pool on
    a CUDA device (never inside a forward); returns their status, None on other devices."""
    if device.type != "cuda":
        return None
    from sgl_pic.ops.cuda import prepare

    status = prepare(device)
    logger.info("sgl_pic CUDA kernels on %s: %s", device, status)
    return status


def calibrate_for_server(settings: Any, hf: Any, cache_pool: Any, ctx: Any) -> dict[str, float]:
    """``--pic-calibrate`` on the scheduler: timed on the KV pool's device and dtype, and
    the same r per tier on every tensor-parallel rank (rank 0 measures; the others take
    its values through the all-reduce), so the ranks' recompute sets and collectives
    match."""
    from sgl_pic.binding.calibration import calibrate_tiers

    kb = cache_pool.get_key_buffer(0)  # [slots, num_kv_heads, head_dim]
    tp = int(getattr(ctx, "tp_size", 1) or 1)
    return calibrate_tiers(
        settings,
        hf,
        device=str(kb.device),
        dtype=kb.dtype,
        reduce=_tp_sum if tp > 1 else None,
        rank=int(getattr(ctx, "tp_rank", 0) or 0),
    )


def record_layout(kv: Any) -> Any:
    """The KV layout of the pool behind ``kv`` (a ``KVAccess``), as lower-tier records
    must hold it: what phase 1 stores (``LowerTiers.put_chunk`` of ``kv.read``) and what
    the layer feed writes back into the pool. A record of another layout, however sound
    its file, is never loaded into the pool: the tiers count it and drop it."""
    from sgl_pic.store.base import DTYPE_NAMES, RecordLayout

    kb = kv.pool.get_key_buffer(0)  # [slots, num_kv_heads, head_dim]
    return RecordLayout(
        num_layers=int(kv.num_layers),
        num_kv_heads=int(kb.shape[1]),
        head_dim=int(kb.shape[2]),
        dtype=DTYPE_NAMES.get(kb.dtype, str(kb.dtype)),
    )


def _lower_tiers(
    settings: Any, fingerprint: Any, spec: Any, metrics: Any, layout: Any = None
) -> Any:
    """Host and disk tiers (``lower_tiers_of``). Their queued disk writes finish (bounded)
    or are dropped cleanly when this scheduler process exits or gets SIGTERM/SIGINT,
    counted into ``metrics`` (``lifecycle``)."""
    from sgl_pic.binding.lifecycle import install_shutdown

    lower = lower_tiers_of(settings, fingerprint, spec, layout)
    # build_tree_cache runs on the scheduler's main thread, where signal handlers can be set.
    return lower, install_shutdown(lower, metrics)


def lower_tiers_of(settings: Any, fingerprint: Any, spec: Any, layout: Any = None) -> Any:
    """Host and disk tiers keyed by the pre-RoPE fingerprint, rotating keys as the model's
    RoPE does (``spec``: its ``RopeSpec``; frequencies and pairing both, since phase 1
    stores keys un-rotated by that pairing). With the disk tier off, its place is a
    zero-capacity tier in a private temporary directory that keeps nothing."""
    import tempfile

    from sgl_pic.engine.lower_tiers import LowerTiers
    from sgl_pic.store.disk import DiskStoreConfig
    from sgl_pic.store.host import HostStoreConfig
    from sgl_pic.store.tiered import TieredStore, TieredStoreConfig

    pre = dataclasses.replace(fingerprint, pre_rope=True)
    if settings.disk_cache_dir:
        disk = DiskStoreConfig(
            settings.disk_cache_dir,
            settings.disk_cache_mb * 2**20,
            policy=settings.eviction,
            namespace_max_bytes=settings.namespace_disk_mb * 2**20,
        )
        write_back = "on_put"
    else:
        disk = DiskStoreConfig(tempfile.mkdtemp(prefix="sgl_pic_nodisk_"), 0)
        write_back = "on_evict"
    host = HostStoreConfig(
        settings.host_cache_mb * 2**20,
        policy=settings.eviction,
        write_back=write_back,
        namespace_max_bytes=settings.namespace_host_mb * 2**20,
    )
    # Disk hits enter host memory only when it exists; a zero-capacity host tier would
    # make every promotion a wasted full read.
    has_host = settings.host_cache_mb > 0
    config = TieredStoreConfig(host, disk, promote_on_get=has_host, promote_on_get_layers=has_host)
    shared = None
    if getattr(settings, "shared_store", ""):
        from sgl_pic.engine.lower_tiers import open_shared_tier

        shared = open_shared_tier(settings.shared_store, pre.digest(), layout)
    store = TieredStore(config, pre.digest(), shared=shared, layout=layout)
    # Loads land in host memory; on a GPU the layer feed stages them through pinned memory
    # and copies them on a side stream, one event per layer (``layer_feed``).
    return LowerTiers(
        store,
        pre,
        settings.config.segment_tokens,
        spec.inv_freq.cpu(),
        layout=spec.layout,
        device="cpu",
    )


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    """# same shape as ``t``: its sum over the tensor-parallel ranks."""
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(t.clone())


def _tp_max(t: torch.Tensor) -> torch.Tensor:
    """# same shape as ``t`` (a small int64 host tensor): its elementwise maximum over the
    tensor-parallel ranks, through the TP group's gloo CPU group, as SGLang's scheduler
    makes its ranks reject the same requests before any model collective
    (``scheduler_components.request_receiver``): no device sync, nothing on the stream
    SGLang's forwards use."""
    from sglang.srt.distributed import get_tp_group

    out = t.clone()
    torch.distributed.all_reduce(
        out, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group
    )
    return out
