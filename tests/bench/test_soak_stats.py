"""bench/soak_stats.py: each request's outcome, and the per-kind counts, latency
percentiles and throughput the soak reports."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def stats() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the soak's modules import each other by bare name
    try:
        yield importlib.import_module("soak_stats")
    finally:
        sys.path.remove(str(BENCH))


def rec(m: ModuleType, kind: str, outcome: str, latency: float = 1.0, status: int = 200):
    return m.Record(kind, "", "a", status, latency, 0.0, 0, outcome, "")


@pytest.mark.parametrize(
    ("status", "valid", "stream_error", "want"),
    [
        (200, True, False, "ok"),
        (200, True, True, "stream_error"),
        (400, True, False, "refused_valid"),
        (503, True, False, "5xx"),
        (500, False, False, "5xx"),
        (400, False, False, "rejected"),
        (413, False, False, "rejected"),
        (200, False, False, "accepted_malformed"),
        (404, False, False, "wrong_4xx"),
    ],
)
def test_outcome_of(
    stats: ModuleType, status: int, valid: bool, stream_error: bool, want: str
) -> None:
    assert stats.outcome_of(status, valid, stream_error) == want


def test_kind_stats_counts_and_percentiles(stats: ModuleType) -> None:
    recs = [rec(stats, "plain", "ok", latency=float(i)) for i in range(1, 101)]
    recs += [rec(stats, "plain", "unavailable", status=0), rec(stats, "plain", "timeout", 300.0)]
    recs += [rec(stats, "malformed", "rejected", 0.5, 400), rec(stats, "malformed", "5xx", 1, 500)]
    recs += [rec(stats, "burst:chat", "ok"), rec(stats, "burst:plain", "aborted")]
    got = stats.kind_stats(recs, seconds=50.0)
    assert set(got) == {"plain", "malformed", "burst"}
    plain = got["plain"]
    assert (plain.sent, plain.answered, plain.unavailable, plain.errors) == (102, 100, 1, 1)
    assert plain.errors_by_outcome == {"timeout": 1}
    # Nearest rank over the answered latencies 1..100 s only (the timeout is no answer).
    assert (plain.p50_s, plain.p95_s, plain.p99_s) == (50.0, 95.0, 99.0)
    assert plain.throughput_per_s == 2.0
    bad = got["malformed"]
    assert (bad.refused, bad.answered, bad.errors, bad.p50_s) == (1, 0, 1, 0.5)
    assert got["burst"].aborted == 1 and got["burst"].answered == 1


def test_kind_without_answers_has_no_percentiles(stats: ModuleType) -> None:
    got = stats.kind_stats([rec(stats, "chat", "connection_error", status=0)], 10.0)
    assert got["chat"].p50_s is None and got["chat"].throughput_per_s == 0.0
    assert "chat" in stats.format_table(got)


def test_totals(stats: ModuleType) -> None:
    recs = [rec(stats, "plain", "ok"), rec(stats, "chat", "5xx", status=502)]
    recs.append(rec(stats, "plain", "unavailable", status=0))
    t = stats.totals(recs)
    assert t == {
        "requests": 3,
        "answered": 1,
        "by_outcome": {"5xx": 1, "ok": 1, "unavailable": 1},
        "errors": 1,
        "5xx": 1,
    }
