"""How many clients the soak runs (``bench/soak.py --find-concurrency``): the mix at 1, 2,
4, ... clients for a while each, until latency or timeouts say the server is saturated;
the choice is the fewest clients that reach (nearly) the best throughput without a
timeout, so the server stays busy and no client waits past its timeout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from _common import percentile
from soak_stats import Record

# A level saturates the servers when its answered throughput gains less than this over
# the previous level, or its median latency is this many times the first level's.
MIN_GAIN = 0.10
MAX_SLOWDOWN = 4.0
# Throughput within this share of the best counts as reaching it.
NEAR_BEST = 0.10


class Level(NamedTuple):
    """One step of the ramp: ``clients`` for ``seconds``."""

    clients: int
    seconds: float
    answered: int
    timeouts: int
    errors: int  # outcomes other than ok, rejected, aborted
    p50_s: float | None
    throughput_per_s: float


def level(clients: int, seconds: float, records: Sequence[Record]) -> Level:
    """A ramp step from the records its clients left."""
    ok = [r.latency for r in records if r.outcome == "ok"]
    return Level(
        clients=clients,
        seconds=round(seconds, 2),
        answered=len(ok),
        timeouts=sum(r.outcome == "timeout" for r in records),
        errors=sum(r.outcome not in ("ok", "rejected", "aborted") for r in records),
        p50_s=round(percentile(ok, 0.5), 4) if ok else None,
        throughput_per_s=round(len(ok) / seconds, 4) if seconds > 0 else 0.0,
    )


def saturated(levels: Sequence[Level]) -> str:
    """Why the last level saturates the servers ('' when it does not)."""
    last = levels[-1]
    if last.timeouts:
        return f"{last.timeouts} timeouts at {last.clients} clients"
    if last.p50_s is None:
        return f"nothing answered at {last.clients} clients"
    base = levels[0].p50_s
    if base and last.p50_s > MAX_SLOWDOWN * base:
        return f"median latency {last.p50_s:.2f} s over {MAX_SLOWDOWN:g}x {base:.2f} s"
    if len(levels) > 1:
        prev = levels[-2].throughput_per_s
        if prev and last.throughput_per_s < (1 + MIN_GAIN) * prev:
            return (
                f"throughput {last.throughput_per_s:.3f}/s gained < {MIN_GAIN:.0%} on {prev:.3f}/s"
            )
    return ""


class Choice(NamedTuple):
    clients: int
    reason: str


def choose(levels: Sequence[Level]) -> Choice:
    """The fewest clients, among levels without timeouts, whose throughput is within
    ``NEAR_BEST`` of the best such level's."""
    usable = [lv for lv in levels if not lv.timeouts and lv.answered]
    if not usable:
        return Choice(1, "no level answered without timeouts: 1 client")
    best = max(lv.throughput_per_s for lv in usable)
    pick = min(
        (lv for lv in usable if lv.throughput_per_s >= (1 - NEAR_BEST) * best),
        key=lambda lv: lv.clients,
    )
    return Choice(
        pick.clients,
        f"{pick.clients} clients: {pick.throughput_per_s:.3f} answered/s, within "
        f"{NEAR_BEST:.0%} of the best {best:.3f}/s, no timeouts",
    )
