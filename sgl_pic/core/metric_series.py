"""sgl_pic's Prometheus series, each declared once: ``PicSeries`` below is the table (kind,
name, help, labels, buckets per series), and ``PicMetrics`` (``metrics.py``) makes one
Prometheus object of each and records into them. The README's metrics table is made from
the same declarations: ``python -m sgl_pic.core.metric_series`` prints it.
``PicSeries`` stays over the class-size limit: it is that table, one declaration a series.

A series is a class attribute ``Series(kind, name, help, labels=...)``; on a ``PicMetrics``
instance the same attribute is the Prometheus object (typed as its kind), so callers write
``metrics.hits.labels(kind="contiguous").inc()`` as with hand-made attributes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from prometheus_client import Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)


@dataclass(frozen=True)
class Series(Generic[M]):
    """One series' declaration. ``name`` is prometheus_client's (a counter is exported with
    ``_total`` added); ``labels`` its label names; ``buckets`` a histogram's upper bounds.
    Gauges report the most recent value of any process (SGLang's multiprocess collector)."""

    kind: type[M]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def make(self) -> M:
        """The Prometheus object (registered in the default registry: once per process)."""
        kwargs: dict[str, Any] = {}
        if self.kind is Gauge:
            kwargs["multiprocess_mode"] = "mostrecent"
        if self.buckets is not None:
            kwargs["buckets"] = self.buckets
        return self.kind(self.name, self.help, list(self.labels), **kwargs)

    @property
    def exported(self) -> str:
        """The name /metrics shows."""
        return self.name + "_total" if self.kind is Counter else self.name

    # On an instance the attribute is the object ``make`` built (it sits in the instance's
    # __dict__, which wins over this non-data descriptor); these overloads type it so.
    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Series[M]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> M: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(f"{self.name} is not made yet (PicMetrics.__init__ makes it)")


class PicSeries:
    """The declared series, in the order /metrics lists them. Attribute: series."""

    requests = Series(Counter, "sgl_pic_requests", "Chunked requests executed")
    fallbacks = Series(
        Counter,
        "sgl_pic_fallbacks",
        "Chunked request pieces run without reuse (input logprobs, or no scratch row or "
        "slots to plan a request split into prefill pieces)",
    )
    split_requests = Series(
        Counter,
        "sgl_pic_split_requests",
        "Chunked requests planned whole at their first of several prefill pieces",
    )
    pieces = Series(
        Counter,
        "sgl_pic_prefill_pieces",
        "Prefill pieces of split chunked requests run with their request's plan",
    )
    resumed = Series(
        Counter,
        "sgl_pic_resumed",
        "Chunked requests prefilled again with their output so far after SGLang retracted "
        "them under KV pressure (run as SGLang would)",
    )
    failures = Series(
        Counter, "sgl_pic_failures", "Batches whose chunk execution failed and ran without reuse"
    )
    retries = Series(
        Counter,
        "sgl_pic_retries",
        "Batches run again after a stored chunk failed its checks while loading",
    )
    chunks = Series(Counter, "sgl_pic_chunk_lookups", "Chunks looked up")
    hits = Series(Counter, "sgl_pic_chunk_hits", "Chunk store hits", labels=("kind",))
    device_prefix = Series(
        Counter, "sgl_pic_chunk_device_prefix", "Chunks inside the device prefix (never recomputed)"
    )
    misses = Series(Counter, "sgl_pic_chunk_misses", "Chunks computed independently")
    deferred = Series(
        Counter,
        "sgl_pic_chunk_deferred",
        "Missed chunks not stored: computed in context like fresh text, because store "
        "admission waits for a second sight (--pic-admission)",
    )
    admission_reuse_rate = Series(
        Gauge,
        "sgl_pic_admission_reuse_rate",
        "Share of recently first-seen chunks that were seen again (store admission's "
        "signal: below its threshold, adaptive admission stores only second sights)",
    )
    encoded = Series(
        Counter,
        "sgl_pic_encoded_tokens",
        "Tokens of missed chunks computed on their own (phase 1); phase 2 may recompute "
        "some of them again, in context",
    )
    reused = Series(Counter, "sgl_pic_reused_tokens", "Tokens whose cached KV was reused")
    recomputed = Series(Counter, "sgl_pic_recomputed_tokens", "Tokens recomputed in phase 2")
    new_tokens = Series(Counter, "sgl_pic_new_tokens", "Tokens past the device prefix")
    selection = Series(
        Histogram,
        "sgl_pic_selection_seconds",
        "Time to choose the recomputed tokens",
        buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
    )
    tier_hits = Series(
        Counter, "sgl_pic_tier_hits", "Reused chunks by source tier", labels=("tier",)
    )
    prefix_hit_tokens = Series(
        Counter,
        "sgl_pic_prefix_hit_tokens",
        "L_hit = max(device prefix, contiguous hit group) tokens, summed over requests",
    )
    bytes_loaded = Series(
        Counter, "sgl_pic_bytes_loaded", "KV bytes moved out of host memory and disk (sparse)"
    )
    bytes_dense = Series(
        Counter, "sgl_pic_bytes_dense", "KV bytes loading those chunks whole would have moved"
    )
    promotions = Series(
        Counter, "sgl_pic_promotions", "Host or disk chunks copied into chunk nodes after use"
    )
    node_insert_failures = Series(
        Counter,
        "sgl_pic_node_insert_failures",
        "New chunks not kept as chunk nodes (pool share full of locked nodes, or no slots)",
    )
    store_errors = Series(
        Counter,
        "sgl_pic_store_errors",
        "Host/disk tier failures by kind (corrupt, truncated, foreign_model, enospc, ...)",
        labels=("kind",),
    )
    calibrated_r = Series(
        Gauge,
        "sgl_pic_calibrated_r",
        "CacheTune recompute ratio chosen per tier by start-up calibration",
        labels=("tier",),
    )
    node_tokens = Series(
        Gauge,
        "sgl_pic_chunk_node_tokens",
        "Pool slots held by chunk nodes",
    )
    marks_ignored = Series(
        Counter,
        "sgl_pic_marks_ignored",
        "Requests whose chunk marks the scheduler did not honour (unsigned, bad signature, "
        "malformed, over a limit, tokens changed); each ran as exact prefill",
        labels=("reason",),
    )
    requests_refused = Series(
        Counter,
        "sgl_pic_requests_refused",
        "Requests the scheduler refused with an error (e.g. token ids outside the vocabulary)",
        labels=("reason",),
    )
    deleted_records = Series(
        Counter,
        "sgl_pic_deleted_records",
        "Chunk records removed by deletion orders (POST /pic/delete here, or another "
        "server's through the shared store's log), by tier",
        labels=("tier",),
    )
    queue_drops = Series(
        Counter,
        "sgl_pic_queue_drops",
        "Background jobs dropped because their bounded queue was full or closed",
        labels=("queue",),
    )
    shutdown_writes = Series(
        Counter,
        "sgl_pic_shutdown_writes",
        "Queued tier writes at shutdown, by outcome (completed or dropped; never partial)",
        labels=("outcome",),
    )
    feed_timeouts = Series(
        Counter,
        "sgl_pic_feed_timeouts",
        "Host/disk layer feeds that stalled past the timeout (the batch ran as exact prefill)",
    )
    phase2_runs = Series(
        Counter,
        "sgl_pic_phase2_runs",
        "Contiguous runs of recomputed tokens phase 2 ran as extend sub-requests",
    )
    probe_passes = Series(
        Counter,
        "sgl_pic_probe_passes",
        "Query-probe forwards (one per batch and qa_layers value, for all its requests)",
    )
    # Forwards of few tokens cost more per token than SGLang's one extend forward of
    # the whole batch (on a CPU, bench/layer_batch.py): these show how phases split it.
    phase_forwards = Series(
        Counter,
        "sgl_pic_phase_forwards",
        "Forwards the chunk path ran, by phase (phase1, probe, deviation, phase2)",
        labels=("phase",),
    )
    phase_forward_tokens = Series(
        Counter,
        "sgl_pic_phase_forward_tokens",
        "Tokens in those forwards, by phase (probe and deviation passes stop after their "
        "first layers)",
        labels=("phase",),
    )
    # Recomputed tokens lie late in the prompt (the question reads recent chunks most),
    # so each attends more keys than an average prompt token: attention costs more per
    # computed token than in a whole-prompt prefill.
    phase_attended_keys = Series(
        Counter,
        "sgl_pic_phase_attended_keys",
        "Keys the queries of those forwards attend, summed, by phase (a query at position "
        "p attends p + 1); over phase_forward_tokens: keys per query",
        labels=("phase",),
    )
    run_merges = Series(
        Counter,
        "sgl_pic_run_merges",
        "Times phase-2 runs were merged across a wider gap to fit the backend's batch",
    )
    unsupported = Series(
        Gauge,
        "sgl_pic_unsupported",
        "1 when chunk reuse is off because the method does not cover the model or "
        "backend (the reason label says which); every request then runs exact",
        labels=("reason",),
    )
    shared_store_up = Series(
        Gauge,
        "sgl_pic_shared_store_up",
        "1 while the shared chunk tier (--pic-shared-store) is reachable",
    )
    shared_store_unreachable = Series(
        Counter,
        "sgl_pic_shared_store_unreachable",
        "Times the shared chunk tier became unreachable (the server kept serving from "
        "its own tiers)",
    )
    shared_writes = Series(
        Counter,
        "sgl_pic_shared_writes",
        "Chunk writes to the shared tier by outcome (stored; present: another server had "
        "stored it; failed; skipped: store down)",
        labels=("outcome",),
    )
    evictions = Series(
        Counter,
        "sgl_pic_evictions",
        "Cached chunk segments evicted, by tier (device: chunk nodes; host; disk)",
        labels=("tier",),
    )
    namespace_hits = Series(
        Counter,
        "sgl_pic_namespace_chunk_hits",
        "Chunks reused from any tier, by namespace (--pic-namespace-metrics)",
        labels=("namespace",),
    )
    namespace_misses = Series(
        Counter,
        "sgl_pic_namespace_chunk_misses",
        "Chunks computed independently, by namespace (--pic-namespace-metrics)",
        labels=("namespace",),
    )
    namespace_node_tokens = Series(
        Gauge,
        "sgl_pic_namespace_chunk_node_tokens",
        "Pool slots held by chunk nodes, by namespace (--pic-namespace-metrics)",
        labels=("namespace",),
    )
    namespace_tier_bytes = Series(
        Gauge,
        "sgl_pic_namespace_tier_bytes",
        "Bytes held in the host and disk tiers, by namespace (--pic-namespace-metrics)",
        labels=("namespace", "tier"),
    )
    hit_rate = Series(Gauge, "sgl_pic_last_hit_rate", "Chunk hit rate of the last request")
    recomputed_fraction = Series(
        Gauge, "sgl_pic_last_recomputed_fraction", "Recomputed / new tokens of the last request"
    )
    first_token_entropy = Series(
        Histogram,
        "sgl_pic_first_token_entropy",
        "Entropy (nats) of the first-token distribution of requests served by reuse, the "
        "signal that ranks their drift from exact prefill (meta_info pic_first_token_entropy)",
        buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
    )
    weight_updates = Series(
        Counter,
        "sgl_pic_weight_updates",
        "Weight updates SGLang applied (by source); each re-keys every chunk tier, so no KV "
        "of the old weights is served after it",
        labels=("source",),
    )


def declared_series(cls: type = PicSeries) -> tuple[tuple[str, Series[Any]], ...]:
    """(attribute, declaration) of every series of ``cls`` and its bases, in declaration
    order."""
    out = []
    for klass in reversed(cls.__mro__):
        out += [(k, v) for k, v in vars(klass).items() if isinstance(v, Series)]
    return tuple(out)


def markdown_table() -> str:
    """A Markdown table of every series: exported name, kind, labels, help."""
    rows = ["| series | kind | labels | what it counts |", "| --- | --- | --- | --- |"]
    for _, s in declared_series():
        labels = ", ".join(f"`{label}`" for label in s.labels)
        what = s.help.replace("|", "\\|")
        rows.append(f"| `{s.exported}` | {s.kind.__name__.lower()} | {labels} | {what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
