"""The host, disk and shared tiers under the device chunk nodes, as the executor uses them.

Records there hold keys before RoPE (CacheTune B.3), under a fingerprint with
``pre_rope=True``, so their keys never collide with the device nodes' post-RoPE ones. New
chunks are written through to host memory when phase 1 computes them (the host's writer
thread then puts them on disk, off the request's path, and a second thread into the
shared tier when there is one); a lower-tier hit is loaded sparsely, layer by layer, only
the tokens not recomputed (``LayerFeed``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from sgl_pic.keys import ModelFingerprint, SegmentKey, segment_keys
from sgl_pic.rope import RopeLayout, rotate_layers
from sgl_pic.store.base import ChunkKV, RecordLayout
from sgl_pic.store.loader import ChunkPlacement, LoaderConfig, SparseLoader
from sgl_pic.store.shared.store import SharedStore
from sgl_pic.store.tiered import ShutdownReport, Tier, TieredStore

# Below the device chunk nodes, fastest first (a chunk's tier is the slowest of its segments').
LOWER_TIERS: tuple[Tier, ...] = ("host", "disk", "shared")

logger = logging.getLogger(__name__)


class QueueDropMetrics(Protocol):
    """The part of ``PicMetrics`` that ``export_stats`` writes."""

    queue_drops: Any  # prometheus Counter, label "queue"


class SharedTierMetrics(Protocol):
    """The part of ``PicMetrics`` that ``export_shared_stats`` writes."""

    shared_store_up: Any  # prometheus Gauge
    shared_store_unreachable: Any  # prometheus Counter
    shared_writes: Any  # prometheus Counter, label "outcome"


class LowerHit(NamedTuple):
    """A chunk all of whose segments are in host memory, on disk or in the shared tier.

    tier:    the slowest tier any segment is read from ("host", "disk" or "shared").
    keys:    the segments' keys, in order.
    ranking: # [n] the chunk's CacheTune ranking, or None if a segment has none.
    namespace: the isolation namespace the chunk was found in.
    context: the digest of the tokens it was encoded after ("" alone).
    """

    tier: Tier
    keys: tuple[SegmentKey, ...]
    ranking: torch.Tensor | None
    namespace: str = ""
    context: str = ""


def _check_pre_rope(fingerprint: ModelFingerprint) -> None:
    if not fingerprint.pre_rope:
        raise ValueError("lower tiers hold pre-RoPE keys: the fingerprint needs pre_rope=True")


class LowerTiers:
    """store: the tiered host/disk store (its model digest is ``fingerprint.digest()``).
    fingerprint: the model's fingerprint with ``pre_rope=True``.
    inv_freq: # [head_dim // 2] RoPE frequencies of the model."""

    def __init__(
        self,
        store: TieredStore,
        fingerprint: ModelFingerprint,
        segment_tokens: int,
        inv_freq: torch.Tensor,
        layout: RopeLayout = "neox",
        device: str = "cpu",
    ) -> None:
        _check_pre_rope(fingerprint)
        if store.model_digest != fingerprint.digest():
            raise ValueError("the tiered store was built for another model fingerprint")
        self.store = store
        self.fingerprint = fingerprint
        self.model_digest = fingerprint.digest()
        self.segment_tokens = segment_tokens
        self.inv_freq = inv_freq
        self.layout: RopeLayout = layout
        self.loader = SparseLoader(store, inv_freq, LoaderConfig(layout, device))
        self._drops_seen: dict[str, int] = {}
        self._export_lock = threading.Lock()
        self._shared_seen: dict[str, int] = {}
        self._shared_listening = False

    def export_stats(self, metrics: QueueDropMetrics) -> dict[str, int]:
        """Adds to ``metrics.queue_drops{queue}`` the jobs each background queue refused
        since the last call (full, or shut down); returns those gains. The label is the
        store's queue name ("writeback", "tier_promotion", "shared_write"). With a
        shared tier, also ``export_shared_stats``. Safe from any thread; call it
        after each batch, like ``record_store_errors``."""
        gained: dict[str, int] = {}
        with self._export_lock:
            for name, stats in self.store.queue_stats().items():
                delta = stats.dropped - self._drops_seen.get(name, 0)
                self._drops_seen[name] = stats.dropped
                if delta > 0:
                    metrics.queue_drops.labels(queue=name).inc(delta)
                    gained[name] = delta
        if self.store.shared is not None:
            # The executor calls only this after a batch; with a shared tier its metrics
            # object is the full ``PicMetrics``.
            self.export_shared_stats(metrics)  # type: ignore[arg-type]
        return gained

    def export_shared_stats(self, metrics: SharedTierMetrics) -> None:
        """The shared tier's link state, outages and write outcomes since the last call
        (call it after each batch). No-op without the tier."""
        shared = self.store.shared
        if shared is None:
            return
        self._export_shared_counts(metrics)
        with self._export_lock:
            listen = not self._shared_listening
            self._shared_listening = True
        if listen:
            # Writes finish after their batch was exported: from now on each one exports
            # the counts itself, so a write's outcome shows without a later request.
            shared.on_write(lambda: self._export_shared_counts(metrics))

    def _export_shared_counts(self, metrics: SharedTierMetrics) -> None:
        """Link state, outages and write outcomes gained since the last export."""
        shared = self.store.shared
        assert shared is not None
        with self._export_lock:
            link = shared.link_stats()
            metrics.shared_store_up.set(1 if link.up else 0)
            totals = {"outages": link.outages, **shared.write_counts()}
            for name, total in totals.items():
                delta = total - self._shared_seen.get(name, 0)
                self._shared_seen[name] = total
                if delta <= 0:
                    continue
                if name == "outages":
                    metrics.shared_store_unreachable.inc(delta)
                else:
                    metrics.shared_writes.labels(outcome=name).inc(delta)

    def shutdown(self, timeout_s: float, stop: threading.Event | None = None) -> ShutdownReport:
        """``TieredStore.shutdown``: queued disk writes finish within ``timeout_s`` or are
        dropped cleanly, and the store's threads are joined. Lookups keep working
        afterwards; nothing more reaches the disk. See ``lifecycle`` for when it runs."""
        return self.store.shutdown(timeout_s, stop)

    def rekey(self, fingerprint: ModelFingerprint) -> None:
        """Keys every chunk from now on under ``fingerprint`` (pre-RoPE; the served
        weights changed: ``binding.weight_updates``). Records keyed under the old one stay
        in every tier for servers of those weights and are never found from here. Records
        written from now on still carry the launch digest (``model_digest``) in their
        header: a server launched with the new weights finds their keys and refuses them
        as foreign, a miss, never another model's KV."""
        _check_pre_rope(fingerprint)
        self.fingerprint = fingerprint

    def keys(
        self, token_ids: Sequence[int], namespace: str = "", context: str = ""
    ) -> tuple[SegmentKey, ...]:
        return segment_keys(
            list(token_ids), self.fingerprint, self.segment_tokens, namespace, context
        )

    def match(
        self, token_ids: Sequence[int], namespace: str = "", context: str = ""
    ) -> LowerHit | None:
        """Whether every segment of the chunk in ``namespace``, encoded after ``context``
        ("" alone), is held, and the chunk's ranking (read from the record in host memory,
        or from the file header on disk). Changes no access counts."""
        keys = self.keys(token_ids, namespace, context)
        tiers: list[Tier] = []
        rankings: list[torch.Tensor | None] = []
        for k in keys:
            tier = self.store.locate(k.digest)
            if tier not in LOWER_TIERS:
                return None
            peek = self.store.peek_ranking(k.digest, token_ids[k.start : k.end])
            if peek is None:
                return None
            tiers.append(tier)
            rankings.append(peek.ranking)
        slowest = max(tiers, key=LOWER_TIERS.index)
        ranking = None if any(r is None for r in rankings) else torch.cat(rankings)  # type: ignore[arg-type]
        return LowerHit(slowest, keys, ranking, namespace, context)

    def placements(
        self,
        hit: LowerHit,
        token_ids: Sequence[int],
        chunk_start: int,
        recompute: torch.Tensor,  # [k] int64 chunk-local indices recomputed (not loaded)
    ) -> list[ChunkPlacement]:
        """One placement per segment: where it lands and which of its tokens are loaded."""
        out = []
        for k in hit.keys:
            local = recompute[(recompute >= k.start) & (recompute < k.end)] - k.start
            out.append(
                ChunkPlacement(
                    k.digest,
                    k.end - k.start,
                    chunk_start + k.start,
                    local,
                    tuple(token_ids[k.start : k.end]),
                )
            )
        return out

    def put_chunk(
        self,
        token_ids: Sequence[int],
        k_pre: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim], keys before RoPE
        v: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
        context: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> int:
        """Writes the chunk's segments of ``namespace`` (encoded after ``context``, whose
        first chunk's contents are ``context_contents``) not yet held; returns how many
        were newly kept."""
        kept = 0
        for k in self.keys(token_ids, namespace, context):
            if self.store.contains(k.digest):
                continue
            kept += self.put_segment(
                k,
                token_ids,
                k_pre[:, k.start : k.end],
                v[:, k.start : k.end],
                None if ranking is None else ranking[k.start : k.end],
                namespace,
                context_contents,
            )
        return kept

    def put_segment(
        self,
        key: SegmentKey,
        token_ids: Sequence[int],  # the whole chunk's
        k_pre: torch.Tensor,  # [num_layers, key.end - key.start, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_layers, key.end - key.start, num_kv_heads, head_dim]
        ranking: torch.Tensor | None,  # [key.end - key.start]
        namespace: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> bool:
        """Writes one segment of a chunk (``keys``' ``key``) whatever the tiers hold; True
        when kept. Phase 1 hands its segments over one at a time, each assembled from
        pieces of the chunk. The tiers may keep the tensors (the shared tier's queue):
        the caller never writes them again."""
        record = ChunkKV(
            key=key.digest,
            model_digest=self.model_digest,
            token_ids=tuple(token_ids[key.start : key.end]),
            k=k_pre.contiguous(),
            v=v.contiguous(),
            ranking=None if ranking is None else ranking.float(),
            namespace=namespace,
            context_contents=context_contents,
        )
        return bool(self.store.put(record))

    def load_full(self, hit: LowerHit, token_ids: Sequence[int]) -> torch.Tensor | None:
        """# [num_layers, 2, n, num_kv_heads, head_dim], keys post-RoPE at 0..n-1 (the
        device nodes' form), or None if a segment is gone or bad."""
        ks, vs = [], []
        for k in hit.keys:
            record = self.store.get(k.digest, token_ids[k.start : k.end])
            if record is None:
                return None
            ks.append(record.k)
            vs.append(record.v)
        k_pre = torch.cat(ks, dim=1)
        positions = torch.arange(k_pre.shape[1], device=k_pre.device)
        k_post = rotate_layers(k_pre, positions, self.inv_freq, self.layout)
        return torch.stack([k_post, torch.cat(vs, dim=1).to(k_post.dtype)], dim=1)


def open_shared_tier(
    url: str, model_digest: str, layout: RecordLayout | None = None
) -> SharedStore:
    """The shared tier at ``url`` for records of ``model_digest`` (the pre-RoPE
    fingerprint's digest). Never waits for the store: it is joined in the background, and
    until then (and whenever it is down) lookups miss and writes are skipped, counted,
    with one log line per outage."""
    from sgl_pic.store.shared.store import SharedStoreConfig

    logger.info("sgl_pic: shared chunk tier at %s", url)
    return SharedStore(SharedStoreConfig(url), model_digest, layout=layout)
