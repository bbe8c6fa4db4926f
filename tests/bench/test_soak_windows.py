"""bench/soak_windows.py: what a fault window cost, from the request records: requests to
the servers it struck while it lasted, their outcomes, and when they served again."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def windows() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the soak's modules import each other by bare name
    try:
        yield importlib.import_module("soak_windows")
    finally:
        sys.path.remove(str(BENCH))


def rec(m: ModuleType, server: str, t: float, outcome: str, latency: float = 1.0):
    status = 200 if outcome == "ok" else 0
    return m.Record("plain", "", server, status, latency, t, 0, outcome, "")


def test_kill_window_cost(windows: ModuleType) -> None:
    w = windows.Window("kill9", start=100.0, servers=("a",))
    w.close(130.0)  # restarted
    recs = [
        rec(windows, "a", 90.0, "ok"),  # before: not its cost
        rec(windows, "a", 101.0, "unavailable"),
        rec(windows, "a", 110.0, "unavailable"),
        rec(windows, "b", 110.0, "ok"),  # the other server: not its cost
        rec(windows, "a", 125.0, "connection_error"),
        rec(windows, "a", 131.0, "ok", latency=4.0),  # answered at 135
        rec(windows, "a", 140.0, "ok"),  # after it served again
    ]
    canary = [(105.0, "unavailable"), (133.0, "match"), (150.0, "match")]
    c = windows.cost(w, recs, canary)
    assert c.sent == 4
    assert c.by_outcome == {"connection_error": 1, "ok": 1, "unavailable": 2}
    assert (c.failed, c.unavailable, c.five_xx) == (1, 2, 0)
    assert c.serving_again_s == 35.0
    assert c.canary == {"match": 1, "unavailable": 1}


def test_window_whose_server_never_served_again_is_not_ok(windows: ModuleType) -> None:
    w = windows.Window("kill9", start=10.0, servers=("a",))
    w.close(20.0)
    recs = [rec(windows, "a", 12.0, "unavailable"), rec(windows, "b", 30.0, "ok")]
    (row,) = windows.summarize([w], recs, [])
    assert row["cost"]["serving_again_s"] is None
    assert row["ok"] is False
    # A window that never closed is no success either, whatever was answered.
    open_w = windows.Window("disk_full", start=0.0, servers=("b",))
    (row,) = windows.summarize([open_w], recs, [])
    assert row["cost"]["serving_again_s"] == 31.0 and row["ok"] is False


def test_failed_checks_fail_the_window(windows: ModuleType) -> None:
    w = windows.Window("corrupt", start=0.0, servers=("a",), ok=False)
    w.close(5.0)
    (row,) = windows.summarize([w], [rec(windows, "a", 1.0, "ok")], [])
    assert row["ok"] is False


def test_outside_leaves_out_only_the_named_windows_struck_servers(windows: ModuleType) -> None:
    kill = windows.Window("kill9", start=10.0, servers=("a",))
    kill.close(20.0)
    burst = windows.Window("burst", start=30.0, servers=("a", "b"))
    burst.close(35.0)
    recs = [
        rec(windows, "a", 5.0, "ok"),
        rec(windows, "a", 15.0, "5xx"),
        rec(windows, "b", 15.0, "5xx"),
        rec(windows, "a", 32.0, "5xx"),
    ]
    kept = windows.outside(recs, [kill, burst], {"kill9"})
    assert [(r.server, r.t) for r in kept] == [("a", 5.0), ("b", 15.0), ("a", 32.0)]
