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

Each series is declared once, in ``metric_series.PicSeries`` (name, kind, help, labels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import Counter, Gauge

from sgl_pic.core.metric_series import PicSeries, declared_series


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


class PicMetrics(PicSeries):
    """sgl_pic's series (declared in ``PicSeries``, one Prometheus object each) and how a
    request's figures are recorded into them. One per scheduler process: Prometheus names
    are global. Scheduler thread only."""

    def __init__(self) -> None:
        for attr, series in declared_series(PicSeries):
            setattr(self, attr, series.make())
        # Per-namespace series: none appear unless ``enable_namespaces`` is called.
        self.namespace_labels = NamespaceLabels()
        self._namespace_gauges_seen: dict[str, set[tuple[str, ...]]] = {}
        self._errors_seen: dict[str, int] = {}
        self._evictions_seen: dict[str, int] = {}

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
