"""sgl_pic's series in SGLang's Prometheus /metrics.

They are created in the scheduler process; SGLang sets PROMETHEUS_MULTIPROC_DIR before it
spawns that process, so prometheus_client's multiprocess collector behind /metrics (in the
HTTP process) reads them. Ratios (hit rate, recomputed fraction) are left to PromQL over the
counters, e.g. ``sgl_pic_chunk_hits_total / sgl_pic_chunk_lookups_total``; the last
request's values are also exported as gauges for a glance.
"""

from __future__ import annotations

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


class PicMetrics:
    def __init__(self) -> None:
        self.requests = Counter("sgl_pic_requests", "Chunked requests executed")
        self.fallbacks = Counter(
            "sgl_pic_fallbacks",
            "Chunked requests run without reuse (split by chunked prefill, or input logprobs)",
        )
        self.failures = Counter(
            "sgl_pic_failures", "Batches whose chunk execution failed and ran without reuse"
        )
        self.chunks = Counter("sgl_pic_chunk_lookups", "Chunks looked up")
        self.hits = Counter("sgl_pic_chunk_hits", "Chunk store hits", ["kind"])
        self.device_prefix = Counter(
            "sgl_pic_chunk_device_prefix", "Chunks inside the device prefix (never recomputed)"
        )
        self.misses = Counter("sgl_pic_chunk_misses", "Chunks computed independently")
        self.reused = Counter("sgl_pic_reused_tokens", "Tokens whose cached KV was reused")
        self.recomputed = Counter("sgl_pic_recomputed_tokens", "Tokens recomputed in phase 2")
        self.new_tokens = Counter("sgl_pic_new_tokens", "Tokens past the device prefix")
        self.selection = Histogram(
            "sgl_pic_selection_seconds",
            "Time to choose the recomputed tokens",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
        )
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
        self.reused.inc(s.reused_tokens)
        self.recomputed.inc(s.recomputed_tokens)
        self.new_tokens.inc(s.new_tokens)
        self.selection.observe(s.selection_seconds)
        if s.chunks:
            hits = s.contiguous_hits + s.disjoint_hits + s.device_prefix_chunks
            self.hit_rate.set(hits / s.chunks)
        if s.new_tokens:
            self.recomputed_fraction.set(s.recomputed_tokens / s.new_tokens)
