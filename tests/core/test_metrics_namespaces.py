"""Per-namespace series (``metrics.NamespaceLabels``): off unless enabled, labelled by a
digest prefix, at most N labels of their own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sgl_pic.core.metrics import LABEL_DIGITS, NamespaceLabels, RequestStats
from sgl_pic.core.tenants import isolation_namespace

A = isolation_namespace("tenant-A", None)
B = isolation_namespace(None, "salt-B")
C = isolation_namespace("tenant-C", None)


def stats(hits: int, misses: int) -> RequestStats:
    return RequestStats(hits + misses, 0, hits, 0, misses, 0, 0, 0, 0.0)


def samples(metric: Any) -> dict[tuple[str, ...], float]:
    out = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[tuple(s.labels.values())] = s.value
    return out


@pytest.fixture
def enabled(metrics: Any) -> Iterator[Any]:
    metrics.enable_namespaces(2)
    yield metrics
    metrics.enable_namespaces(0)


def test_labels_are_digest_prefixes_bounded_in_number() -> None:
    assert NamespaceLabels()(A) is None  # off by default
    labels = NamespaceLabels(2)
    assert labels("") == "default"
    assert labels(A) == A[:LABEL_DIGITS] and len(labels(A) or "") == 12
    assert labels(B) == "other" and labels(C) == "other"  # past the limit
    assert labels(A) == A[:LABEL_DIGITS]  # a label once given is kept
    assert labels.sums({"": 1, A: 2, B: 3, C: 4}) == {"default": 1, A[:12]: 2, "other": 7}
    with pytest.raises(ValueError):
        NamespaceLabels(-1)


def test_nothing_is_recorded_per_namespace_unless_enabled(metrics: Any) -> None:
    metrics.enable_namespaces(0)
    before = samples(metrics.namespace_hits), samples(metrics.namespace_node_tokens)
    metrics.record_namespace(A, stats(2, 1))
    metrics.record_namespace_sizes({A: 10}, {"host": {A: 100}})
    assert (samples(metrics.namespace_hits), samples(metrics.namespace_node_tokens)) == before


def test_hits_misses_and_sizes_per_namespace(enabled: Any) -> None:
    m = enabled
    hits0, misses0 = samples(m.namespace_hits), samples(m.namespace_misses)
    m.record_namespace(A, stats(2, 1))
    m.record_namespace(B, stats(0, 3))
    m.record_namespace(C, stats(1, 0))  # third namespace: "other"
    hits, misses = samples(m.namespace_hits), samples(m.namespace_misses)
    a, b = A[:LABEL_DIGITS], B[:LABEL_DIGITS]
    assert hits[(a,)] - hits0.get((a,), 0) == 2 and misses[(b,)] - misses0.get((b,), 0) == 3
    assert hits[("other",)] - hits0.get(("other",), 0) == 1
    m.record_namespace_sizes({A: 10, C: 4}, {"host": {A: 100, B: 50}, "disk": {C: 7}})
    assert samples(m.namespace_node_tokens)[(a,)] == 10
    assert samples(m.namespace_node_tokens)[("other",)] == 4
    tiers = samples(m.namespace_tier_bytes)
    assert tiers[(a, "host")] == 100 and tiers[(b, "host")] == 50 and tiers[("other", "disk")] == 7
    # A namespace that holds nothing any more reads 0, not its last value.
    m.record_namespace_sizes({C: 4}, {"host": {}, "disk": {}})
    assert samples(m.namespace_node_tokens)[(a,)] == 0
    assert samples(m.namespace_tier_bytes)[(a, "host")] == 0
    # Labels never carry a key or salt.
    assert not any("tenant" in k[0] or "salt" in k[0] for k in samples(m.namespace_hits))
