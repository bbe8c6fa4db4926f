"""sgl_pic's series in SGLang's Prometheus /metrics.

They are created in the scheduler process; SGLang sets PROMETHEUS_MULTIPROC_DIR before it
spawns that process, so prometheus_client's multiprocess collector behind /metrics (in the
HTTP process) reads them. Ratios (hit rate, recomputed fraction) are left to PromQL over the
counters, e.g. ``sgl_pic_chunk_hits_total / sgl_pic_chunk_lookups_total``; the last
request's values are also exported as gauges for a glance.

Per-namespace (tenant) series exist only where the operator asks for them
(``--pic-namespace-metrics N``): each is labelled by a short prefix of the namespace's
digest ("default" for the default namespace), never by a salt or key, and at most N
namespaces get a label of their own, the rest sharing "other" (``NamespaceLabels``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import Counter, Gauge, Histogram


class RequestStats(NamedTuple):
    """What one chunked request did."""

    chunks: int  # chunks in the prompt
    device_prefix_chunks: int  # chunks wholly inside the exact device prefix
    contiguous_hits: int  # store hits adjoining the device prefix or a previous hit
    disjoint_hits: int  # store hits after a miss
    misses: int  # chunks computed in phase 1
    reused_tokens: int  # tokens whose KV came from the store and was kept
    recomputed_tokens: int  # tokens computed in phase 2
    new_tokens: int  # tokens past the device prefix
    selection_seconds: float
    device_hits: int = 0  # reused chunks found in chunk nodes
    host_hits: int = 0  # ... in host memory
    disk_hits: int = 0  # ... on disk
    shared_hits: int = 0  # ... in the shared tier (--pic-shared-store)
    prefix_hit_tokens: int = 0  # DARIC's L_hit = max(L_gpu, L_cont)
    encoded_tokens: int = 0  # tokens of the missed chunks, computed on their own in phase 1
    deferred: int = 0  # missed chunks store admission did not store (computed in context)


# Hex digits of a namespace digest a label keeps: enough to tell tenants apart on a
# dashboard, far too few to stand for the digest.
LABEL_DIGITS = 12


class NamespaceLabels:
    """The label of each namespace in the per-namespace series: the first ``limit`` seen
    get their own (kept for the process's life), later ones "other". ``limit`` 0: off,
    no label at all. Scheduler thread only."""

    def __init__(self, limit: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"the namespace label limit must be >= 0, got {limit}")
        self.limit = limit
        self._own: dict[str, str] = {}

    def __call__(self, namespace: str) -> str | None:
        if not self.limit:
            return None
        label = self._own.get(namespace)
        if label is not None:
            return label
        if len(self._own) >= self.limit:
            return "other"
        label = "default" if namespace == "" else namespace[:LABEL_DIGITS]
        self._own[namespace] = label
        return label

    def sums(self, values: Mapping[str, int]) -> dict[str, int]:
        """``values`` per namespace, summed per label ({} when off)."""
        out: dict[str, int] = {}
        for ns, v in values.items():
            label = self(ns)
            if label is not None:
                out[label] = out.get(label, 0) + v
        return out


class PicMetrics:
    def __init__(self) -> None:
        self.requests = Counter("sgl_pic_requests", "Chunked requests executed")
        self.fallbacks = Counter(
            "sgl_pic_fallbacks",
            "Chunked request pieces run without reuse (chunked-prefill pieces before the last, "
            "or input logprobs)",
        )
        self.resumed = Counter(
            "sgl_pic_resumed",
            "Chunked requests prefilled again with their output so far after SGLang retracted "
            "them under KV pressure (run as SGLang would)",
        )
        self.failures = Counter(
            "sgl_pic_failures", "Batches whose chunk execution failed and ran without reuse"
        )
        self.retries = Counter(
            "sgl_pic_retries",
            "Batches run again after a stored chunk failed its checks while loading",
        )
        self.chunks = Counter("sgl_pic_chunk_lookups", "Chunks looked up")
        self.hits = Counter("sgl_pic_chunk_hits", "Chunk store hits", ["kind"])
        self.device_prefix = Counter(
            "sgl_pic_chunk_device_prefix", "Chunks inside the device prefix (never recomputed)"
        )
        self.misses = Counter("sgl_pic_chunk_misses", "Chunks computed independently")
        self.deferred = Counter(
            "sgl_pic_chunk_deferred",
            "Missed chunks not stored: computed in context like fresh text, because store "
            "admission waits for a second sight (--pic-admission)",
        )
        self.admission_reuse_rate = Gauge(
            "sgl_pic_admission_reuse_rate",
            "Share of recently first-seen chunks that were seen again (store admission's "
            "signal: below its threshold, adaptive admission stores only second sights)",
            multiprocess_mode="mostrecent",
        )
        self.encoded = Counter(
            "sgl_pic_encoded_tokens",
            "Tokens of missed chunks computed on their own (phase 1); phase 2 may recompute "
            "some of them again, in context",
        )
        self.reused = Counter("sgl_pic_reused_tokens", "Tokens whose cached KV was reused")
        self.recomputed = Counter("sgl_pic_recomputed_tokens", "Tokens recomputed in phase 2")
        self.new_tokens = Counter("sgl_pic_new_tokens", "Tokens past the device prefix")
        self.selection = Histogram(
            "sgl_pic_selection_seconds",
            "Time to choose the recomputed tokens",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
        )
        self.tier_hits = Counter("sgl_pic_tier_hits", "Reused chunks by source tier", ["tier"])
        self.prefix_hit_tokens = Counter(
            "sgl_pic_prefix_hit_tokens",
            "L_hit = max(device prefix, contiguous hit group) tokens, summed over requests",
        )
        self.bytes_loaded = Counter(
            "sgl_pic_bytes_loaded", "KV bytes moved out of host memory and disk (sparse)"
        )
        self.bytes_dense = Counter(
            "sgl_pic_bytes_dense", "KV bytes loading those chunks whole would have moved"
        )
        self.promotions = Counter(
            "sgl_pic_promotions", "Host or disk chunks copied into chunk nodes after use"
        )
        self.node_insert_failures = Counter(
            "sgl_pic_node_insert_failures",
            "New chunks not kept as chunk nodes (pool share full of locked nodes, or no slots)",
        )
        self.store_errors = Counter(
            "sgl_pic_store_errors",
            "Host/disk tier failures by kind (corrupt, truncated, foreign_model, enospc, ...)",
            ["kind"],
        )
        self.calibrated_r = Gauge(
            "sgl_pic_calibrated_r",
            "CacheTune recompute ratio chosen per tier by start-up calibration",
            ["tier"],
            multiprocess_mode="mostrecent",
        )
        self.node_tokens = Gauge(
            "sgl_pic_chunk_node_tokens",
            "Pool slots held by chunk nodes",
            multiprocess_mode="mostrecent",
        )
        self.marks_ignored = Counter(
            "sgl_pic_marks_ignored",
            "Requests whose chunk marks the scheduler did not honour (unsigned, bad signature, "
            "malformed, over a limit, tokens changed); each ran as exact prefill",
            ["reason"],
        )
        self.requests_refused = Counter(
            "sgl_pic_requests_refused",
            "Requests the scheduler refused with an error (e.g. token ids outside the vocabulary)",
            ["reason"],
        )
        self.deleted_records = Counter(
            "sgl_pic_deleted_records",
            "Chunk records removed by deletion orders (POST /pic/delete here, or another "
            "server's through the shared store's log), by tier",
            ["tier"],
        )
        self.queue_drops = Counter(
            "sgl_pic_queue_drops",
            "Background jobs dropped because their bounded queue was full or closed",
            ["queue"],
        )
        self.shutdown_writes = Counter(
            "sgl_pic_shutdown_writes",
            "Queued tier writes at shutdown, by outcome (completed or dropped; never partial)",
            ["outcome"],
        )
        self.feed_timeouts = Counter(
            "sgl_pic_feed_timeouts",
            "Host/disk layer feeds that stalled past the timeout (the batch ran as exact prefill)",
        )
        self.phase2_runs = Counter(
            "sgl_pic_phase2_runs",
            "Contiguous runs of recomputed tokens phase 2 ran as extend sub-requests",
        )
        self.probe_passes = Counter(
            "sgl_pic_probe_passes",
            "Query-probe forwards (one per batch and qa_layers value, for all its requests)",
        )
        # Forwards of few tokens cost more per token than SGLang's one extend forward of
        # the whole batch (on a CPU, bench/layer_batch.py): these show how phases split it.
        self.phase_forwards = Counter(
            "sgl_pic_phase_forwards",
            "Forwards the chunk path ran, by phase (phase1, probe, deviation, phase2)",
            ["phase"],
        )
        self.phase_forward_tokens = Counter(
            "sgl_pic_phase_forward_tokens",
            "Tokens in those forwards, by phase (probe and deviation passes stop after their "
            "first layers)",
            ["phase"],
        )
        # Recomputed tokens lie late in the prompt (the question reads recent chunks most),
        # so each attends more keys than an average prompt token: attention costs more per
        # computed token than in a whole-prompt prefill.
        self.phase_attended_keys = Counter(
            "sgl_pic_phase_attended_keys",
            "Keys the queries of those forwards attend, summed, by phase (a query at position "
            "p attends p + 1); over phase_forward_tokens: keys per query",
            ["phase"],
        )
        self.run_merges = Counter(
            "sgl_pic_run_merges",
            "Times phase-2 runs were merged across a wider gap to fit the backend's batch",
        )
        self.unsupported = Gauge(
            "sgl_pic_unsupported",
            "1 when chunk reuse is off because the method does not cover the model or "
            "backend (the reason label says which); every request then runs exact",
            ["reason"],
            multiprocess_mode="mostrecent",
        )
        self.shared_store_up = Gauge(
            "sgl_pic_shared_store_up",
            "1 while the shared chunk tier (--pic-shared-store) is reachable",
            multiprocess_mode="mostrecent",
        )
        self.shared_store_unreachable = Counter(
            "sgl_pic_shared_store_unreachable",
            "Times the shared chunk tier became unreachable (the server kept serving from "
            "its own tiers)",
        )
        self.shared_writes = Counter(
            "sgl_pic_shared_writes",
            "Chunk writes to the shared tier by outcome (stored; present: another server had "
            "stored it; failed; skipped: store down)",
            ["outcome"],
        )
        self.evictions = Counter(
            "sgl_pic_evictions",
            "Cached chunk segments evicted, by tier (device: chunk nodes; host; disk)",
            ["tier"],
        )
        # Per-namespace series: none appear unless ``namespace_labels`` is enabled.
        self.namespace_labels = NamespaceLabels()
        self.namespace_hits = Counter(
            "sgl_pic_namespace_chunk_hits",
            "Chunks reused from any tier, by namespace (--pic-namespace-metrics)",
            ["namespace"],
        )
        self.namespace_misses = Counter(
            "sgl_pic_namespace_chunk_misses",
            "Chunks computed independently, by namespace (--pic-namespace-metrics)",
            ["namespace"],
        )
        self.namespace_node_tokens = Gauge(
            "sgl_pic_namespace_chunk_node_tokens",
            "Pool slots held by chunk nodes, by namespace (--pic-namespace-metrics)",
            ["namespace"],
            multiprocess_mode="mostrecent",
        )
        self.namespace_tier_bytes = Gauge(
            "sgl_pic_namespace_tier_bytes",
            "Bytes held in the host and disk tiers, by namespace (--pic-namespace-metrics)",
            ["namespace", "tier"],
            multiprocess_mode="mostrecent",
        )
        self._namespace_gauges_seen: dict[str, set[tuple[str, ...]]] = {}
        self._errors_seen: dict[str, int] = {}
        self._evictions_seen: dict[str, int] = {}
        self.hit_rate = Gauge(
            "sgl_pic_last_hit_rate",
            "Chunk hit rate of the last request",
            multiprocess_mode="mostrecent",
        )
        self.recomputed_fraction = Gauge(
            "sgl_pic_last_recomputed_fraction",
            "Recomputed / new tokens of the last request",
            multiprocess_mode="mostrecent",
        )

    def record(self, s: RequestStats) -> None:
        self.requests.inc()
        self.chunks.inc(s.chunks)
        self.hits.labels(kind="contiguous").inc(s.contiguous_hits)
        self.hits.labels(kind="disjoint").inc(s.disjoint_hits)
        self.device_prefix.inc(s.device_prefix_chunks)
        self.misses.inc(s.misses)
        self.deferred.inc(s.deferred)
        self.encoded.inc(s.encoded_tokens)
        self.reused.inc(s.reused_tokens)
        self.recomputed.inc(s.recomputed_tokens)
        self.new_tokens.inc(s.new_tokens)
        self.selection.observe(s.selection_seconds)
        self.tier_hits.labels(tier="device").inc(s.device_hits)
        self.tier_hits.labels(tier="host").inc(s.host_hits)
        self.tier_hits.labels(tier="disk").inc(s.disk_hits)
        self.tier_hits.labels(tier="shared").inc(s.shared_hits)
        self.prefix_hit_tokens.inc(s.prefix_hit_tokens)
        if s.chunks:
            hits = s.contiguous_hits + s.disjoint_hits + s.device_prefix_chunks
            self.hit_rate.set(hits / s.chunks)
        if s.new_tokens:
            self.recomputed_fraction.set(s.recomputed_tokens / s.new_tokens)

    def enable_namespaces(self, limit: int) -> None:
        """Per-namespace series for at most ``limit`` namespaces (0: off); called once,
        when the scheduler's cache is built."""
        self.namespace_labels = NamespaceLabels(limit)

    def record_namespace(self, namespace: str, s: RequestStats) -> None:
        """One request's chunk hits and misses under its namespace's label (nothing when
        per-namespace metrics are off)."""
        label = self.namespace_labels(namespace)
        if label is None:
            return
        self.namespace_hits.labels(namespace=label).inc(s.contiguous_hits + s.disjoint_hits)
        self.namespace_misses.labels(namespace=label).inc(s.misses)

    def record_namespace_sizes(
        self, node_tokens: Mapping[str, int], tier_bytes: Mapping[str, Mapping[str, int]]
    ) -> None:
        """Sets the per-namespace gauges from the chunk nodes' slots and each lower tier's
        bytes per namespace; a label no longer holding anything reads 0."""
        if not self.namespace_labels.limit:
            return
        self._set_gauges(
            self.namespace_node_tokens,
            "nodes",
            {(k,): v for k, v in self.namespace_labels.sums(node_tokens).items()},
        )
        bytes_by = {
            (label, tier): v
            for tier, per_ns in tier_bytes.items()
            for label, v in self.namespace_labels.sums(per_ns).items()
        }
        self._set_gauges(self.namespace_tier_bytes, "tiers", bytes_by)

    def _set_gauges(self, gauge: Gauge, name: str, values: Mapping[tuple[str, ...], int]) -> None:
        seen = self._namespace_gauges_seen.setdefault(name, set())
        for labels in seen - values.keys():
            gauge.labels(*labels).set(0)
        for labels, v in values.items():
            gauge.labels(*labels).set(v)
        seen.update(values)

    def record_store_errors(self, errors: Mapping[str, int]) -> None:
        """Adds what the tiers' cumulative error counts gained since the last call."""
        _add_gains(self.store_errors, "kind", self._errors_seen, errors)

    def record_evictions(self, totals: Mapping[str, int]) -> None:
        """Adds what each tier's cumulative eviction count gained since the last call."""
        _add_gains(self.evictions, "tier", self._evictions_seen, totals)


def _add_gains(
    counter: Counter, label: str, seen: dict[str, int], totals: Mapping[str, int]
) -> None:
    """Adds to ``counter{label=key}`` what each cumulative total gained since ``seen``
    (updated): the stores count from their start, Prometheus counters only go up."""
    for key, total in totals.items():
        gained = total - seen.get(key, 0)
        if gained > 0:
            counter.labels(**{label: key}).inc(gained)
        seen[key] = total
