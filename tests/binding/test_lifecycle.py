"""Shutdown of the host/disk tiers: queued disk writes finish within the timeout or are
dropped cleanly (only complete, checksum-valid files; no temp file), both counted and
logged in one line, threads joined; on SIGTERM/SIGINT of the process and at exit."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from sgl_pic.binding import lifecycle
from sgl_pic.binding.lifecycle import ShutdownHook, install_shutdown
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.format import TMP_PREFIX, read_record
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.engine.test_lower_tiers import (
    DIM,
    FP,
    HEADS,
    INV_FREQ,
    LAYERS,
    SEG,
    FakeMetrics,
)
from tests.store.helpers import hold_disk_writes
from tests.support.fakes import chunk_data

REPO = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(
    r"sgl_pic shutdown \((?P<reason>\w+)\): queued tier writes completed=(?P<completed>\d+) "
    r"dropped=(?P<dropped>\d+) \(failed=(?P<failed>\d+)\), promotions dropped=\d+, "
    r"threads joined=(?P<joined>yes|no)"
)


def make_lower(root: Path) -> LowerTiers:
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False),
        disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 22),
    )
    return LowerTiers(TieredStore(cfg, FP.digest()), FP, SEG, INV_FREQ)


def put_segments(lower: LowerTiers, n: int) -> None:
    """``n`` one-segment chunks, each queued for a write to disk."""
    for seed in range(n):
        c = chunk_data(seed, SEG, LAYERS, HEADS, DIM, INV_FREQ)
        assert lower.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 1


def check_disk(root: Path, expected_files: int) -> None:
    """Only complete, checksum-valid chunk files, exactly ``expected_files``; no temp."""
    found = [p for p in root.rglob("*") if p.is_file()]
    assert not [p for p in found if p.name.startswith(TMP_PREFIX)]
    records = [p for p in found if p.suffix == ".sglkv"]
    assert len(records) == expected_files
    for p in records:
        read_record(p, FP.digest())  # verifies every checksum


@pytest.fixture
def lower(tmp_path: Path) -> Iterator[LowerTiers]:
    lt = make_lower(tmp_path)
    yield lt
    lt.store.close()


def test_run_drains_counts_logs_once_and_joins(lower, tmp_path, monkeypatch, caplog) -> None:
    # No write starts before the drain: its report counts what it did, so a write that a
    # slow runner finished before it would be in no count.
    held = hold_disk_writes(monkeypatch, 0.1)
    put_segments(lower, 10)
    metrics = FakeMetrics()
    hook = ShutdownHook(lower, metrics, timeout_s=0.35)
    hook.before.append(held.release.set)
    with caplog.at_level(logging.INFO, logger="sgl_pic.binding.lifecycle"):
        report = hook.run("test")
        assert hook.run("again") is report  # idempotent: no second drain, count or line
    lines = [r.getMessage() for r in caplog.records if "sgl_pic shutdown" in r.getMessage()]
    assert len(lines) == 1
    m = LOG_LINE.search(lines[0])
    assert m is not None and m["reason"] == "test" and m["joined"] == "yes"
    assert int(m["completed"]) == report.completed and int(m["dropped"]) == report.dropped
    assert report.completed + report.dropped == 10 and report.dropped > 0
    assert metrics.value("sgl_pic_shutdown_writes", outcome="completed") == report.completed
    assert metrics.value("sgl_pic_shutdown_writes", outcome="dropped") == report.dropped
    assert not lower.store.host._writer.thread_alive
    assert not lower.store._promoter.thread_alive
    monkeypatch.undo()
    check_disk(tmp_path, report.completed)


def test_write_backs_refused_after_shutdown_are_queue_drops(lower, tmp_path) -> None:
    metrics = FakeMetrics()
    hook = ShutdownHook(lower, metrics, timeout_s=5.0)
    put_segments(lower, 2)
    report = hook.run("test")
    # Fast writes may finish before the drain, which then has nothing left to count.
    assert lower.store.queue_stats()["writeback"].completed == 2
    assert report.dropped == 0 and report.completed <= 2
    c = chunk_data(50, SEG, LAYERS, HEADS, DIM, INV_FREQ)
    assert lower.put_chunk(c.tokens, c.pre_k, c.v, c.ranking) == 1  # kept in memory
    assert lower.export_stats(metrics) == {"writeback": 1}
    check_disk(tmp_path, 2)


class AtExit:
    """Records what the lifecycle module registers at exit (the real registry cannot be
    inspected, and must not keep a hook of a test's store)."""

    def __init__(self) -> None:
        self.funcs: list[object] = []

    def register(self, func: object) -> None:
        self.funcs.append(func)

    def unregister(self, func: object) -> None:
        self.funcs = [f for f in self.funcs if f != func]


@pytest.fixture
def at_exit(monkeypatch: pytest.MonkeyPatch) -> Iterator[AtExit]:
    fake = AtExit()
    monkeypatch.setattr(lifecycle, "atexit", fake)
    # A shell starting the suite in the background leaves SIGINT ignored, which the hook
    # rightly leaves alone; these tests install over Python's own handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield fake
    signal.signal(signal.SIGINT, previous)


def test_install_and_uninstall_restore_the_process_state(lower, at_exit) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    hook = install_shutdown(lower, None, timeout_s=1.0)
    try:
        for sig in before:
            assert signal.getsignal(sig) == hook._on_signal
        assert at_exit.funcs == [hook._at_exit]
    finally:
        hook.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before
    assert at_exit.funcs == []


def test_an_ignored_signal_is_left_alone(lower, at_exit) -> None:
    prev = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    hook = ShutdownHook(lower, None)
    try:
        hook.install([signal.SIGUSR1])
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        hook.uninstall()
        signal.signal(signal.SIGUSR1, prev)


def test_off_the_main_thread_only_atexit_is_registered(lower, at_exit) -> None:
    before = signal.getsignal(signal.SIGTERM)
    hook = ShutdownHook(lower, None)
    t = threading.Thread(target=hook.install)
    t.start()
    t.join()
    try:
        assert signal.getsignal(signal.SIGTERM) == before
        assert at_exit.funcs == [hook._at_exit]
    finally:
        hook.uninstall()


# A scheduler stand-in: a store with slow disk writes, the hook installed as the plugin
# does, PicMetrics in prometheus multiprocess mode (as under SGLang), then idle.
CHILD = """
import logging, sys, threading, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from sgl_pic.binding.lifecycle import install_shutdown
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.store.disk import store as disk_mod
from tests.binding.test_lifecycle import make_lower, put_segments

root, mode = sys.argv[1], sys.argv[2]
n, delay, timeout = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
real = disk_mod.write_record
go = threading.Event()  # no write starts before the drain, which counts what it does
def slow(*args, **kwargs):
    go.wait(30)
    time.sleep(delay)
    return real(*args, **kwargs)
disk_mod.write_record = slow
lower = make_lower(__import__("pathlib").Path(root))
install_shutdown(lower, PicMetrics(), timeout).before.append(go.set)
put_segments(lower, n)
print("READY", flush=True)
if mode == "exit":
    sys.exit(0)
while True:
    time.sleep(0.05)
"""


def run_child(
    tmp_path: Path, mode: str, n: int, delay: float, timeout_s: float
) -> tuple[subprocess.Popen[str], Path]:
    root, prom = tmp_path / "disk", tmp_path / "prom"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom), "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", CHILD, str(root), mode, str(n), str(delay), str(timeout_s)]
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The child gets SIGINT's default, not an ignore inherited from a background shell.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    if ready.strip() != "READY":
        proc.kill()
        pytest.fail(f"child did not start: {ready!r}\n{proc.communicate()[1]}")
    return proc, prom


def shutdown_metrics(prom: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom))
    return {
        outcome: registry.get_sample_value("sgl_pic_shutdown_writes_total", {"outcome": outcome})
        or 0.0
        for outcome in ("completed", "dropped")
    }


@pytest.mark.parametrize(
    ("mode", "returncode"),
    [("SIGTERM", -signal.SIGTERM), ("SIGINT", -signal.SIGINT), ("exit", 0)],
)
def test_a_process_stopping_with_pending_writes_leaves_valid_files(
    tmp_path, mode, returncode
) -> None:
    """12 writes of 0.15 s each are queued; the process gets SIGTERM or SIGINT, or
    exits: the drain takes about its 0.6 s timeout, some writes complete and the rest
    are dropped, the process then ends as the signal asked (SIGINT: KeyboardInterrupt),
    and the disk holds exactly the completed files, all valid, and no temp file."""
    n = 12
    proc, prom = run_child(tmp_path, mode, n, delay=0.15, timeout_s=0.6)
    t0 = time.monotonic()
    if mode != "exit":
        proc.send_signal(getattr(signal, mode))
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == returncode, err
    assert took < 10.0, err
    lines = [line for line in err.splitlines() if "sgl_pic shutdown" in line]
    assert len(lines) == 1, err
    m = LOG_LINE.search(lines[0])
    assert m is not None, lines[0]
    assert m["reason"] == mode and m["joined"] == "yes" and m["failed"] == "0"
    completed, dropped = int(m["completed"]), int(m["dropped"])
    assert completed + dropped == n and completed >= 1 and dropped >= 1
    check_disk(tmp_path / "disk", completed)
    assert shutdown_metrics(prom) == {"completed": completed, "dropped": dropped}


def test_a_second_sigterm_cuts_the_drain_short(tmp_path) -> None:
    """With a 30 s timeout the drain would run every write; a second SIGTERM drops the
    rest at once and the process ends."""
    n = 20
    proc, _ = run_child(tmp_path, "signal", n, delay=0.15, timeout_s=30.0)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err
    assert time.monotonic() - t0 < 2.5, err
    m = LOG_LINE.search(err)
    assert m is not None, err
    completed, dropped = int(m["completed"]), int(m["dropped"])
    assert completed + dropped == n and dropped >= n // 2
    check_disk(tmp_path / "disk", completed)
