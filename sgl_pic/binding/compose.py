"""The composition root: one scheduler process's parts, built by small builders in order.

``compose`` is the radix-cache factory's body (``plugin.build_tree_cache``): it checks that
the chunk path covers the server, then builds the chunk nodes inside SGLang's tree, the KV
access, the host and disk tiers, the phase runner, the executor, the admission gate and the
``PicRuntime`` that owns them all from then on. Scheduler side, once, on the scheduler's
main thread (signal handlers for the tiers' shutdown are set there).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from sgl_pic.binding.fingerprint import machine_digests, server_fingerprint
from sgl_pic.binding.model_hooks import Support, check_support, install
from sgl_pic.binding.model_rope import RopeSpec, find_rotary, rope_spec
from sgl_pic.binding.phases import PhaseRunner
from sgl_pic.binding.runtime import PicRuntime, set_current
from sgl_pic.binding.self_check import check_page_size
from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.binding.tier_setup import calibrate_for_server, install_lower_tiers
from sgl_pic.binding.tp_collectives import tp_max, tp_sum
from sgl_pic.core.drift_signal import DriftSignal
from sgl_pic.core.gate import AdmissionGate, AdmittedMarks, restamped
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.spans import MarkSigner
from sgl_pic.core.tenants import tenant_policy
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.deleter import Deleter
from sgl_pic.engine.executor import ChunkExecutor
from sgl_pic.engine.forwards import HiddenSpec
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.rank_agreement import RankAgreement
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.keys import ModelFingerprint
from sgl_pic.model_identity import ModelIdentityError
from sgl_pic.selection import ranking_recipe
from sgl_pic.store.admission import StoreAdmission

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Components:
    """What ``compose`` built. ``cache``: the radix cache SGLang gets (``ChunkRadixCache``,
    or SGLang's own tree when reuse is off); ``runtime``: the process's ``PicRuntime``,
    the one owner of the rest from then on."""

    settings: PicServerSettings
    metrics: PicMetrics
    cache: Any
    runtime: PicRuntime


def compose(ctx: Any) -> Components:
    """Builds the parts for SGLang's tree-cache build context ``ctx`` and makes the
    runtime current (``runtime.set_current``)."""
    settings = PicServerSettings.from_env()
    metrics = PicMetrics()
    marks = AdmittedMarks()
    cache_pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    support, fingerprint = check_server(ctx, settings, cache_pool)
    if fingerprint is None:
        return plain_server(ctx, settings, metrics, marks, support)
    metrics.enable_namespaces(settings.namespace_metrics)
    prepare_kernels(cache_pool.get_key_buffer(0).device)
    cache = chunk_cache(ctx, settings, fingerprint, metrics, marks)
    runner = ctx.tp_worker.model_runner
    spec = rope_spec(find_rotary(runner.model), cache_pool.get_key_buffer(0).device)
    kv = KVAccess(cache_pool, int(ctx.model_config.hf_config.num_hidden_layers), ModelRope(spec))
    lower, shutdown = lower_tiers(settings, fingerprint, spec, metrics, kv)
    ratios = None
    if settings.calibrate and lower is not None:
        ratios = calibrate_for_server(settings, ctx.model_config.hf_config, cache_pool, ctx)
        for tier, r in ratios.items():
            metrics.calibrated_r.labels(tier=tier).set(r)
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
    executor = chunk_executor(ctx, settings, cache, kv, metrics, phases, lower, ratios, deleter)
    gate = admission_gate(settings, ctx, metrics, ratios is not None, deleter, marks)
    drift = DriftSignal(metrics.first_token_entropy.observe)
    runtime = PicRuntime(gate, metrics, executor, phases, drift)
    cache.set_split_requests(
        runtime.request_done, executor.held_tokens, executor.forget_split_plans
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
    pool_tokens = int(ctx.params.token_to_kv_pool_allocator.size)
    announce(settings, runner, cache.chunk_nodes.capacity_tokens, pool_tokens, kv, lower, spec)
    set_current(runtime)
    return Components(settings, metrics, cache, runtime)


def check_server(
    ctx: Any, settings: PicServerSettings, cache_pool: Any
) -> tuple[Support, ModelFingerprint | None]:
    """Whether the chunk path covers this server, and the fingerprint chunks are keyed by
    (None when it does not: a model or backend the method does not cover, a page size
    other than the launcher's, ``--pic-check`` refusals, weights with no identity)."""
    support = check_support(ctx)
    if support.ok:
        # The HTTP side pads chunk starts to the launcher's page size; the pool pages at
        # the size SGLang resolved and built.
        support = check_page_size(settings.config.page_size, ctx)
    if support.ok and settings.refused:
        support = Support("model_check", f"{settings.refused}; lifted by dropping --pic-check")
    if not support.ok:
        return support, None
    try:
        # Every chunk is stored with a ranking made at the server's alpha (a setting no
        # request can override), so the alpha is part of every key.
        fingerprint = dataclasses.replace(
            server_fingerprint(ctx, cache_pool.dtype, digests=machine_digests()),
            ranking=ranking_recipe(settings.config.cachetune_alpha),
        )
    except ModelIdentityError as e:
        detail = f"the weights have no identity to key chunks by ({e})"
        return Support("model_identity", detail), None
    return support, fingerprint


def plain_server(
    ctx: Any,
    settings: PicServerSettings,
    metrics: PicMetrics,
    marks: AdmittedMarks,
    support: Support,
) -> Components:
    """Reuse off: SGLang's own tree, built as it would build it (its tiers, connectors and
    model-specific caches then work as without sgl_pic), a gate that runs every request
    exact, the reason in the log and a metric."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    logger.error(
        "sgl_pic: chunk reuse is off (%s): %s; every request runs as exact prefill "
        "(see the README's list of covered models and backends)",
        support.reason,
        support.detail,
    )
    metrics.unsupported.labels(reason=support.reason).set(1)
    vocab_size = int(ctx.model_config.vocab_size)
    gate = AdmissionGate(settings.config, None, vocab_size, metrics, marks=marks)
    runtime = PicRuntime(gate, metrics)
    set_current(runtime)
    return Components(settings, metrics, default_radix_cache_factory(ctx), runtime)


def chunk_cache(
    ctx: Any,
    settings: PicServerSettings,
    fingerprint: ModelFingerprint,
    metrics: PicMetrics,
    marks: AdmittedMarks,
) -> Any:
    """SGLang's tree with chunk nodes in a share of the pool (``ChunkRadixCache``); marks
    of requests SGLang ends (finished or aborted) are dropped by it."""
    from sgl_pic.binding import radix_cache

    capacity = int(settings.device_cache_fraction * ctx.params.token_to_kv_pool_allocator.size)

    def make_table(allocator: Any) -> ChunkNodeTable:
        return ChunkNodeTable(
            allocator,
            fingerprint,
            settings.config.segment_tokens,
            capacity,
            settings.eviction,
            settings.namespace_max_tokens(capacity),
        )

    cache = radix_cache.build(ctx, make_table, metrics.node_tokens.set, marks.drop)
    assert cache.chunk_nodes is not None
    return cache


def lower_tiers(
    settings: PicServerSettings,
    fingerprint: ModelFingerprint,
    spec: RopeSpec,
    metrics: PicMetrics,
    kv: KVAccess,
) -> tuple[LowerTiers | None, Any]:
    """The host and disk tiers and their shutdown (``tier_setup.install_lower_tiers``), or
    (None, None) when they are off, or when the model's rotary table has no plain
    frequencies to store keys by."""
    if not settings.has_lower_tiers:
        return None, None
    if spec.inv_freq is None:
        logger.error(
            "sgl_pic: host and disk tiers are off: they store keys by plain RoPE frequencies, "
            "and this model's rotary table (partial rotary, attention scaling, or a table that "
            "is not one set of RoPE frequencies) has none"
        )
        return None, None
    return install_lower_tiers(settings, fingerprint, spec, metrics, kv)


def chunk_executor(
    ctx: Any,
    settings: PicServerSettings,
    cache: Any,
    kv: KVAccess,
    metrics: PicMetrics,
    phases: PhaseRunner,
    lower: LowerTiers | None,
    ratios: dict[str, float] | None,
    deleter: Deleter,
) -> ChunkExecutor:
    """The executor over the cache's chunk nodes, with the tensor-parallel collectives
    when there is more than one rank."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tp_size = int(getattr(ctx, "tp_size", 1) or 1)
    tp = tp_size > 1
    hf = ctx.model_config.hf_config
    runner = ctx.tp_worker.model_runner
    return ChunkExecutor(
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
        read_cap=settings.read_cap(ctx.model_config, tp_size),
        admission=StoreAdmission(settings.admission),
        reduce=tp_sum if tp else None,
        sync_deletions=deleter.sync if lower is not None else None,
        hidden=HiddenSpec(int(hf.hidden_size), runner.dtype),
        ranks=RankAgreement(tp_max if tp else None),
        # SGLang's prefix tree is evicted from here on one rank only: with tensor
        # parallelism, where every rank's tree must stay alike, chunk nodes alone.
        make_room=None
        if tp
        else lambda n: int(cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted),
    )


def admission_gate(
    settings: PicServerSettings,
    ctx: Any,
    metrics: PicMetrics,
    calibrated: bool,
    deleter: Deleter,
    marks: AdmittedMarks,
) -> AdmissionGate:
    """The gate that verifies marks with the launcher's secret (none: marks are never
    honoured, and the log says so)."""
    if not settings.secret:
        logger.error(
            "sgl_pic: no mark-signing secret (not started by python -m sgl_pic.launch_server); "
            "chunk marks are not honoured and every request runs as exact prefill"
        )
    return AdmissionGate(
        settings.config,
        MarkSigner(settings.secret) if settings.secret else None,
        int(ctx.model_config.vocab_size),
        metrics,
        calibrated,
        tenant_policy(settings),
        deleter,
        marks,
    )


def announce(
    settings: PicServerSettings,
    runner: Any,
    capacity: int,
    pool_tokens: int,
    kv: KVAccess,
    lower: LowerTiers | None,
    spec: RopeSpec,
) -> None:
    """The start-up lines: prefill CUDA graphs kept for plain batches, and the cache's
    shape (chunk nodes up to ``capacity`` of the pool's ``pool_tokens`` slots)."""
    graphs = getattr(runner, "prefill_cuda_graph_runner", None)
    if type(graphs).__name__ == "PrefillCudaGraphRunner":
        logger.info(
            "sgl_pic: SGLang's prefill CUDA graphs stay on for batches without chunked "
            "requests; batches with chunked requests run eagerly"
        )
    disk = "off"
    if settings.disk_cache_dir and lower is not None:
        disk = f"{settings.disk_cache_dir} ({settings.disk_cache_mb} MiB)"
    logger.info(
        "sgl_pic chunk cache ready: policy=%s, model %s, attention backend %s, chunk nodes up "
        "to %d of %d pool slots, host tier %d MiB, disk tier %s, %d layers, rotary dim %d (%s)",
        settings.config.policy,
        type(runner.model).__name__,
        type(runner.attn_backend).__name__,
        capacity,
        pool_tokens,
        settings.host_cache_mb if lower is not None else 0,
        disk,
        kv.num_layers,
        spec.rotary_dim,
        spec.layout,
    )


def prepare_kernels(device: torch.device) -> Any:
    """Builds or loads the CUDA kernels once, at start-up on the scheduler, for a pool on
    a CUDA device (never inside a forward); returns their status, None on other devices."""
    if device.type != "cuda":
        return None
    from sgl_pic.ops.cuda import prepare

    status = prepare(device)
    logger.info("sgl_pic CUDA kernels on %s: %s", device, status)
    return status
