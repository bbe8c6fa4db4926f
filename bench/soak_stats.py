"""The soak's request records and what is counted of them (``bench/soak.py``): each
request's outcome, and per request kind the answered, refused, unavailable and failed
requests, latency percentiles and throughput. Pure: no server, no clock."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

from _common import percentile

# Outcomes that are no error: a valid request answered 200, a malformed one refused with
# 400/413, a stream the client closed on purpose after its first event, a request that
# found its server down during an outage.
FINE = frozenset({"ok", "rejected", "aborted", "unavailable"})


class Record(NamedTuple):
    """One request.

    kind:     plain | chunked:<policy> | chat | chat_tools | frontend | long | abort |
              malformed | delete | burst:<kind> (the burst window's requests).
    sub:      the variant: malformed form, chat layout, tenant field, ...
    server:   which server it went to (a, b).
    status:   HTTP status (0: no answer).
    latency:  seconds from sending to the whole answer (or the failure).
    t:        seconds since the run began, at sending.
    outcome:  ok | rejected (malformed, answered 400/413) | aborted | unavailable (its
              server was down) | 5xx | refused_valid (a valid request got 4xx) |
              accepted_malformed | wrong_4xx | stream_error | connection_error | timeout |
              frontend_error (the frontend program raised).
    """

    kind: str
    sub: str
    server: str
    status: int
    latency: float
    t: float
    client: int
    outcome: str
    error: str

    @property
    def done(self) -> float:
        """When the answer (or the failure) came, seconds since the run began."""
        return self.t + self.latency


def outcome_of(status: int, valid: bool, stream_error: bool) -> str:
    """The outcome of a request that got an HTTP answer with ``status``: ``valid`` says
    whether the request was well formed (a malformed one must get 400 or 413)."""
    if status >= 500:
        return "5xx"
    if valid:
        if status != 200:
            return "refused_valid"
        return "stream_error" if stream_error else "ok"
    if status in (400, 413):
        return "rejected"
    return "accepted_malformed" if status < 400 else "wrong_4xx"


class KindStats(NamedTuple):
    """One request kind over the run. ``refused``: answered 4xx (malformed ones must be);
    ``errors``: outcomes outside ``FINE``; latencies over answered (or refused malformed)
    requests; ``throughput_per_s``: answered requests per second of the run."""

    sent: int
    answered: int
    refused: int
    unavailable: int
    aborted: int
    errors: int
    errors_by_outcome: dict[str, int]
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    throughput_per_s: float


def family(kind: str) -> str:
    """The kind a record's statistics go under: every policy of ``chunked`` on its own,
    the burst's requests under ``burst``."""
    return "burst" if kind.startswith("burst:") else kind


def kind_stats(records: Iterable[Record], seconds: float) -> dict[str, KindStats]:
    """Per kind (``family``), over a run of ``seconds`` (> 0)."""
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[family(r.kind)].append(r)
    out: dict[str, KindStats] = {}
    for kind in sorted(groups):
        recs = groups[kind]
        by = Counter(r.outcome for r in recs)
        timed = [r.latency for r in recs if r.outcome in ("ok", "rejected")]

        def pct(p: float, timed: list[float] = timed) -> float | None:
            return round(percentile(timed, p), 4) if timed else None

        errors = {k: v for k, v in sorted(by.items()) if k not in FINE}
        out[kind] = KindStats(
            sent=len(recs),
            answered=by["ok"],
            refused=sum(1 for r in recs if 400 <= r.status < 500),
            unavailable=by["unavailable"],
            aborted=by["aborted"],
            errors=sum(errors.values()),
            errors_by_outcome=errors,
            p50_s=pct(0.5),
            p95_s=pct(0.95),
            p99_s=pct(0.99),
            throughput_per_s=round(by["ok"] / seconds, 4),
        )
    return out


def totals(records: Iterable[Record]) -> dict[str, Any]:
    """Counts over every record: by outcome, answered, 5xx."""
    by = Counter(r.outcome for r in records)
    return {
        "requests": sum(by.values()),
        "answered": by["ok"],
        "by_outcome": dict(sorted(by.items())),
        "errors": sum(v for k, v in by.items() if k not in FINE),
        "5xx": by["5xx"],
    }


def format_table(stats: dict[str, KindStats]) -> str:
    """The per-kind table as printed at the end of a run."""

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    head = (
        f"{'kind':24s} {'sent':>6s} {'ok':>6s} {'4xx':>5s} {'unav':>5s} {'abrt':>5s} "
        f"{'err':>4s} {'p50 s':>8s} {'p95 s':>8s} {'p99 s':>8s} {'ok/s':>7s}"
    )
    rows = [head]
    for kind, k in stats.items():
        rows.append(
            f"{kind:24s} {k.sent:6d} {k.answered:6d} {k.refused:5d} {k.unavailable:5d} "
            f"{k.aborted:5d} {k.errors:4d} {s(k.p50_s):>8s} {s(k.p95_s):>8s} "
            f"{s(k.p99_s):>8s} {k.throughput_per_s:7.3f}"
        )
    return "\n".join(rows)
