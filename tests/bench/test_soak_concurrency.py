"""bench/soak_concurrency.py: when a ramp level saturates the servers, and which client
count the soak then runs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def ramp() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the soak's modules import each other by bare name
    try:
        yield importlib.import_module("soak_concurrency")
    finally:
        sys.path.remove(str(BENCH))


def lv(m: ModuleType, clients: int, tput: float, p50: float, timeouts: int = 0):
    return m.Level(clients, 60.0, int(tput * 60), timeouts, timeouts, p50, tput)


def test_level_from_records(ramp: ModuleType) -> None:
    R = ramp.Record
    recs = [R("plain", "", "a", 200, float(s), 0.0, 0, "ok", "") for s in (1, 2, 3)]
    recs += [R("plain", "", "a", 0, 300.0, 0.0, 0, "timeout", "")]
    recs += [R("malformed", "", "a", 400, 0.1, 0.0, 0, "rejected", "")]
    got = ramp.level(4, 30.0, recs)
    assert (got.answered, got.timeouts, got.errors, got.p50_s) == (3, 1, 1, 2.0)
    assert got.throughput_per_s == 0.1


def test_saturation(ramp: ModuleType) -> None:
    a = lv(ramp, 1, 1.0, 1.0)
    assert ramp.saturated([a]) == ""
    assert ramp.saturated([a, lv(ramp, 2, 1.8, 1.1)]) == ""
    assert "gained" in ramp.saturated([a, lv(ramp, 2, 1.05, 1.9)])
    assert "median" in ramp.saturated([a, lv(ramp, 2, 3.0, 4.5)])
    assert "timeouts" in ramp.saturated([a, lv(ramp, 2, 3.0, 1.0, timeouts=1)])


def test_choice_is_the_fewest_clients_near_the_best(ramp: ModuleType) -> None:
    levels = [
        lv(ramp, 1, 1.0, 1.0),
        lv(ramp, 2, 1.9, 1.0),
        lv(ramp, 4, 2.0, 2.0),
        lv(ramp, 8, 2.5, 3.0, timeouts=2),  # faster, but clients timed out
    ]
    got = ramp.choose(levels)
    assert got.clients == 2 and "2 clients" in got.reason


def test_choice_without_a_usable_level(ramp: ModuleType) -> None:
    assert ramp.choose([lv(ramp, 1, 0.0, 1.0, timeouts=3)]).clients == 1
