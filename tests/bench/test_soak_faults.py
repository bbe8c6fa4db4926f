"""bench/soak_faults.py's pure pieces: the store errors a window counts from /metrics, and
the wait for a fault's after-effect."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def faults() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the soak's modules import each other by bare name
    try:
        yield importlib.import_module("soak_faults")
    finally:
        sys.path.remove(str(BENCH))


def test_errors_of_counts_only_the_kinds_asked(faults: ModuleType) -> None:
    m = {
        'sgl_pic_store_errors_total{kind="enospc"}': 2.0,
        'sgl_pic_store_errors_total{kind="write_error"}': 2.0,
        'sgl_pic_store_errors_total{kind="corrupt"}': 3.0,
        'sgl_pic_store_errors_total{kind="truncated"}': 1.0,
        'sgl_pic_store_errors_total{kind="shared_corrupt"}': 5.0,
        'sgl_pic_tier_hits_total{tier="disk"}': 7.0,
    }
    assert faults.errors_of(m, ("enospc",)) == 2.0
    assert faults.errors_of(m, ("corrupt", "truncated")) == 4.0
    assert faults.errors_of({}, ("enospc",)) == 0.0


def test_wait_until(faults: ModuleType) -> None:
    calls = iter([False, False, True])
    assert faults.wait_until(lambda: next(calls), 5.0) is not None
    assert faults.wait_until(lambda: False, 0.6) is None
