"""Fault windows of the soak and what each cost (``bench/soak.py``): when a fault began
and was removed, which servers it struck, and from the request records, what was sent to
them inside it, how it ended, and how long until they served again. Pure: the faults
themselves are injected by ``soak_faults``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from soak_stats import FINE, Record


@dataclass
class Window:
    """One fault. ``start``: the fault struck; ``end``: it was removed (server restarted,
    disk emptied, store back, corrupt records checked, burst answered); both seconds since
    the run began. ``servers``: the servers it struck (records to others are not its
    cost). ``checks``: what the fault's own verification found (``ok`` False when a check
    failed, e.g. a corrupt record served); ``detail``: what was done."""

    name: str
    start: float
    servers: tuple[str, ...]
    end: float | None = None
    ok: bool = True
    checks: dict[str, Any] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)

    def close(self, t: float) -> None:
        self.end = t


@dataclass(frozen=True)
class WindowCost:
    """What a window cost. ``sent``: requests to its servers sent from ``start`` until
    they served again (or ``end`` when they never stopped); ``failed``: those whose outcome
    is outside ``FINE``; ``unavailable``: those that met a server that was down;
    ``serving_again_s``: from ``start`` to the first answer (200) of a request to its
    servers sent at or after ``start``, None if none came; ``canary``: canary checks in
    the same span by outcome."""

    sent: int
    by_outcome: dict[str, int]
    failed: int
    unavailable: int
    five_xx: int
    serving_again_s: float | None
    canary: dict[str, int]


def serving_again(w: Window, records: Sequence[Record]) -> float | None:
    """When the first request to ``w``'s servers sent at or after its start was answered."""
    done = [
        r.done for r in records if r.server in w.servers and r.t >= w.start and r.outcome == "ok"
    ]
    return min(done) if done else None


def cost(w: Window, records: Sequence[Record], canary: Iterable[tuple[float, str]]) -> WindowCost:
    """``w``'s cost from the run's records and its canary checks ((t, outcome) pairs)."""
    again = serving_again(w, records)
    until = max(x for x in (w.end, again, w.start) if x is not None)
    inside = [r for r in records if r.server in w.servers and w.start <= r.t <= until]
    by = Counter(r.outcome for r in inside)
    checks = Counter(o for t, o in canary if w.start <= t <= until)
    return WindowCost(
        sent=len(inside),
        by_outcome=dict(sorted(by.items())),
        failed=sum(v for k, v in by.items() if k not in FINE),
        unavailable=by["unavailable"],
        five_xx=by["5xx"],
        serving_again_s=None if again is None else round(again - w.start, 2),
        canary=dict(sorted(checks.items())),
    )


def outside(records: Iterable[Record], windows: Sequence[Window], names: set[str]) -> list[Record]:
    """The records sent outside every window named in ``names`` (to the servers it struck,
    until it ended or they served again); the rest of the records as they are."""
    spans = [
        (w, max(x for x in (w.end, w.start) if x is not None)) for w in windows if w.name in names
    ]
    kept = []
    for r in records:
        hit = False
        for w, until in spans:
            if r.server in w.servers and w.start <= r.t <= until:
                hit = True
                break
        if not hit:
            kept.append(r)
    return kept


def summarize(
    windows: Sequence[Window], records: Sequence[Record], canary: Iterable[tuple[float, str]]
) -> list[dict[str, Any]]:
    """Each window with its cost, as the result file and the printed summary show it."""
    checks = list(canary)
    out = []
    for w in windows:
        c = cost(w, records, checks)
        out.append(
            {
                "name": w.name,
                "start": round(w.start, 2),
                "end": None if w.end is None else round(w.end, 2),
                "servers": list(w.servers),
                "ok": w.ok and w.end is not None and c.serving_again_s is not None,
                "cost": c.__dict__,
                "checks": w.checks,
                "detail": w.detail,
            }
        )
    return out
