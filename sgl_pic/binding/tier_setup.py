"""The host and disk tiers a server builds at start-up: their stores keyed by the
pre-RoPE fingerprint, their shutdown, the record layout of the pool, and ``--pic-calibrate``.
Scheduler side, at start-up (``compose``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_pic.binding.tp_collectives import tp_sum


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
        reduce=tp_sum if tp > 1 else None,
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


def install_lower_tiers(
    settings: Any, fingerprint: Any, spec: Any, metrics: Any, kv: Any
) -> tuple[Any, Any]:
    """Host and disk tiers (``lower_tiers_of``) for the pool behind ``kv`` (a
    ``KVAccess``), and their shutdown. Their queued disk writes finish (bounded)
    or are dropped cleanly when this scheduler process exits or gets SIGTERM/SIGINT,
    counted into ``metrics`` (``lifecycle``)."""
    from sgl_pic.binding.lifecycle import install_shutdown

    lower = lower_tiers_of(settings, fingerprint, spec, record_layout(kv))
    # build_tree_cache runs on the scheduler's main thread, where signal handlers can be set.
    return lower, install_shutdown(lower, metrics)


def lower_tiers_of(settings: Any, fingerprint: Any, spec: Any, layout: Any = None) -> Any:
    """Host and disk tiers keyed by the pre-RoPE fingerprint, rotating keys as the model's
    RoPE does (``spec``: its ``RopeSpec``; frequencies and pairing both, since phase 1
    stores keys un-rotated by that pairing). With the disk tier off, its place is a
    zero-capacity tier in a private temporary directory that keeps nothing."""
    import tempfile

    from sgl_pic.engine.lower_tiers import LowerTiers
    from sgl_pic.store.disk.store import DiskStoreConfig
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
