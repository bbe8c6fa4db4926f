"""Registration with SGLang: the ``sgl_pic`` radix cache backend and the targeted hooks.

``register`` is the ``sglang.srt.plugins`` entry point; SGLang's ``load_plugins()`` calls it
in every process (scheduler included) and then applies the hooks. It is idempotent, so
``python -m sgl_pic.launch_server`` may also call it where no entry point is installed.

Every hook passes straight through to SGLang unless the ``sgl_pic`` backend was built in
that process, so installing the plugin never changes a server that does not select it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sgl_pic.integration.settings import BACKEND_NAME

logger = logging.getLogger(__name__)

_registered = False
_executor: Any = None  # ChunkExecutor of this scheduler process, once the backend is built
_gate: Any = None  # AdmissionGate of this scheduler process, once the backend is built
_req_to_token: torch.Tensor | None = None

MODEL_FORWARD_TARGETS = ("sglang.srt.models.llama.LlamaModel.forward",)
ATTENTION_TARGET = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
)
PREPARE_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
# Called by the scheduler on every generate request before it is queued (the patch
# reaches the scheduler's own ``from ... import`` binding through HookRegistry).
ADMIT_TARGET = "sglang.srt.managers.utils.validate_input_length"
TORCH_NATIVE = "torch_native"


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_pic.integration.attention import torch_native_forward_extend_hook

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_tree_cache)
    for target in MODEL_FORWARD_TARGETS:
        HookRegistry.register(target, _model_forward_hook, HookType.AROUND)
    HookRegistry.register(ATTENTION_TARGET, torch_native_forward_extend_hook, HookType.AROUND)
    HookRegistry.register(PREPARE_TARGET, _after_prepare_for_extend, HookType.AFTER)
    HookRegistry.register(ADMIT_TARGET, _admit_hook, HookType.AROUND)


def build_tree_cache(ctx: Any) -> Any:
    """Radix cache factory: SGLang's own tree plus chunk nodes (``ChunkRadixCache``), the
    host and disk tiers under them, and the executor that uses them."""
    global _executor, _gate, _req_to_token
    from sgl_pic.integration import radix_cache
    from sgl_pic.integration.chunk_nodes import ChunkNodeTable
    from sgl_pic.integration.executor import ChunkExecutor
    from sgl_pic.integration.fingerprint import server_fingerprint
    from sgl_pic.integration.gate import AdmissionGate
    from sgl_pic.integration.kv_access import KVAccess
    from sgl_pic.integration.metrics import PicMetrics
    from sgl_pic.integration.settings import PicServerSettings
    from sgl_pic.integration.spans import MarkSigner
    from sgl_pic.rope import default_inv_freq

    settings = PicServerSettings.from_env()
    hf = ctx.model_config.hf_config
    pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    num_layers = int(hf.num_hidden_layers)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    fingerprint = server_fingerprint(ctx, pool.dtype)
    inv_freq = default_inv_freq(head_dim, _rope_theta(hf))
    vocab_size = int(ctx.model_config.vocab_size)
    pool_tokens = int(ctx.params.token_to_kv_pool_allocator.size)
    capacity = int(settings.device_cache_fraction * pool_tokens)

    def make_table(allocator: Any) -> ChunkNodeTable:
        return ChunkNodeTable(allocator, fingerprint, settings.config.segment_tokens, capacity)

    cache = radix_cache.build(ctx, make_table)
    assert cache.chunk_nodes is not None
    metrics = PicMetrics()
    lower = (
        _lower_tiers(settings, fingerprint, inv_freq, pool, metrics)
        if settings.has_lower_tiers
        else None
    )
    ratios = None
    if settings.calibrate and lower is not None:
        from sgl_pic.integration.calibration import calibrate_tiers

        ratios = calibrate_tiers(settings, hf)
        for tier, r in ratios.items():
            metrics.calibrated_r.labels(tier=tier).set(r)
    kv = KVAccess(pool, num_layers, inv_freq)
    backends = {
        getattr(ctx.server_args, "attention_backend", None),
        getattr(ctx.server_args, "prefill_attention_backend", None),
    } - {None}
    if backends != {TORCH_NATIVE}:
        # The chunk path's grouped attention is a hook on torch_native's extend; another
        # backend would attend the phases as ordinary extends, which is wrong. Chunked
        # requests are then served as plain SGLang prefill (exact, no reuse).
        logger.error(
            "sgl_pic: chunk reuse needs --attention-backend %s (got %s); chunked requests "
            "run without reuse",
            TORCH_NATIVE,
            sorted(backends),
        )
        _gate = AdmissionGate(settings.config, None, vocab_size, metrics)
        return cache
    if not settings.secret:
        logger.error(
            "sgl_pic: no mark-signing secret (not started by python -m sgl_pic.launch_server); "
            "chunk marks are not honoured and every request runs as exact prefill"
        )
    _executor = ChunkExecutor(
        settings.config,
        cache.chunk_nodes,
        kv,
        metrics,
        lower=lower,
        ratios=ratios,
        feed_mode=settings.feed_mode,
        feed_timeout_s=settings.feed_timeout_s,
    )
    _req_to_token = ctx.params.req_to_token_pool.req_to_token
    signer = MarkSigner(settings.secret) if settings.secret else None
    _gate = AdmissionGate(settings.config, signer, vocab_size, metrics)
    logger.info(
        "sgl_pic chunk cache ready: policy=%s, chunk nodes up to %d of %d pool slots, "
        "host tier %d MiB, disk tier %s, %d layers, head dim %d",
        settings.config.policy,
        capacity,
        pool_tokens,
        settings.host_cache_mb,
        f"{settings.disk_cache_dir} ({settings.disk_cache_mb} MiB)"
        if settings.disk_cache_dir
        else "off",
        num_layers,
        head_dim,
    )
    return cache


def _lower_tiers(
    settings: Any, fingerprint: Any, inv_freq: torch.Tensor, pool: Any, metrics: Any
) -> Any:
    """Host and disk tiers keyed by the pre-RoPE fingerprint. With the disk tier off, its
    place is a zero-capacity tier in a private temporary directory that keeps nothing.
    Their queued disk writes finish (bounded) or are dropped cleanly when this scheduler
    process exits or gets SIGTERM/SIGINT, counted into ``metrics`` (``lifecycle``)."""
    import dataclasses
    import tempfile

    from sgl_pic.integration.lifecycle import install_shutdown
    from sgl_pic.integration.lower_tiers import LowerTiers
    from sgl_pic.store.disk import DiskStoreConfig
    from sgl_pic.store.host import HostStoreConfig
    from sgl_pic.store.tiered import TieredStore, TieredStoreConfig

    pre = dataclasses.replace(fingerprint, pre_rope=True)
    if settings.disk_cache_dir:
        disk = DiskStoreConfig(settings.disk_cache_dir, settings.disk_cache_mb * 2**20)
        write_back = "on_put"
    else:
        disk = DiskStoreConfig(tempfile.mkdtemp(prefix="sgl_pic_nodisk_"), 0)
        write_back = "on_evict"
    host = HostStoreConfig(settings.host_cache_mb * 2**20, write_back=write_back)
    # Disk hits enter host memory only when it exists; a zero-capacity host tier would
    # make every promotion a wasted full read.
    has_host = settings.host_cache_mb > 0
    config = TieredStoreConfig(host, disk, promote_on_get=has_host, promote_on_get_layers=has_host)
    store = TieredStore(config, pre.digest())
    device = str(getattr(pool, "device", None) or "cpu")
    lower = LowerTiers(store, pre, settings.config.segment_tokens, inv_freq, device=device)
    # build_tree_cache runs on the scheduler's main thread, where signal handlers can be set.
    install_shutdown(lower, metrics)
    return lower


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise NotImplementedError(f"sgl_pic re-rotation supports plain RoPE only, not {kind!r}")
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None)
    if theta is None:
        raise ValueError("model config has no rope_theta")
    return float(theta)


def _admit_hook(original: Any, req: Any, *args: Any, **kwargs: Any) -> str | None:
    """SGLang's own input checks first; then, on a request SGLang accepts, the gate's."""
    error = original(req, *args, **kwargs)
    if error is not None or _gate is None:
        return error
    return _gate.admit(req)


def _after_prepare_for_extend(result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Hands the batch's chunked requests to the executor, by SGLang's request id. The
    hand-off is replaced per batch: SGLang forwards a batch right after preparing it, on
    this thread, so nothing of an earlier batch may linger into this one."""
    if _executor is None:
        return result
    from sgl_pic.integration.gate import PENDING_ATTR

    handoff = {}
    for req in batch.reqs:
        pending = getattr(req, PENDING_ATTR, None)
        if pending is None:
            continue
        if tuple(req.origin_input_ids) != pending.token_ids:
            logger.warning(
                "sgl_pic: request %s changed tokens after admission; it runs without reuse",
                req.rid,
            )
            _executor.metrics.marks_ignored.labels(reason="tokens_changed").inc()
            continue
        handoff[req.rid] = pending
    _executor.handoff = handoff
    return result


def _model_forward_hook(
    original: Any,
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    forward_batch: Any,
    input_embeds: torch.Tensor | None = None,
    pp_proxy_tensors: Any = None,
    **kwargs: Any,
) -> Any:
    from sgl_pic.integration.attention import GROUPS_ATTR

    def plain() -> Any:
        return original(
            model,
            input_ids,
            positions,
            forward_batch,
            input_embeds,
            pp_proxy_tensors=pp_proxy_tensors,
            **kwargs,
        )

    if (
        _executor is None
        or _req_to_token is None
        or input_embeds is not None
        or pp_proxy_tensors is not None
        or getattr(forward_batch, GROUPS_ATTR, None) is not None
        or not forward_batch.forward_mode.is_extend()
        or forward_batch.extend_prefix_lens_cpu is None
    ):
        return plain()

    def run(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return original(model, ids, pos, forward_batch, **kwargs)

    try:
        hidden = _executor.forward(run, input_ids, positions, forward_batch, _req_to_token)
    except Exception:
        # SGLang kills the whole server when a scheduler raises. Running the batch as SGLang
        # would rewrites every new token's KV from scratch, so whatever the failed attempt
        # wrote is overwritten; the request is served without reuse and the failure counted.
        logger.exception("sgl_pic: chunk execution failed; running the batch without reuse")
        _executor.metrics.failures.inc()
        _reset_groups(forward_batch)
        return plain()
    return plain() if hidden is None else hidden


def _reset_groups(forward_batch: Any) -> None:
    from sgl_pic.integration.attention import GROUPS_ATTR

    setattr(forward_batch, GROUPS_ATTR, None)
