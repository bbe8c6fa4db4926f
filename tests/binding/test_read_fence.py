"""Freed request rows are fenced, not synchronized (``phases.fence_reads``): SGLang's next
writes to the request table wait, on the GPU, for the phase kernels that read those rows.
The fake runner, streams and event are checked against SGLang's source: the scheduler's
WAR barrier reads the same attributes ``fence_reads`` writes."""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

import torch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.model_runner import ModelRunner

from sgl_pic.binding import phases
from sgl_pic.binding.phases import fence_reads


class FakeStream:
    """What ``fence_reads`` asks of a ``torch.cuda.Stream``: equality, a wait on another
    stream, a host sync; each call recorded."""

    def __init__(self, name: str, calls: list[tuple[str, ...]]) -> None:
        self.name, self.calls = name, calls

    def synchronize(self) -> None:
        self.calls.append(("synchronize", self.name))

    def wait_stream(self, other: FakeStream) -> None:
        self.calls.append(("wait_stream", self.name, other.name))


class FakeEvent:
    def __init__(self, calls: list[tuple[str, ...]]) -> None:
        self.calls = calls

    def record(self, stream: FakeStream) -> None:
        self.calls.append(("record", stream.name))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    log: list[tuple[str, ...]] = []
    streams = {n: FakeStream(n, log) for n in ("forward", "schedule")}
    state = {"current": streams["forward"], "log": log, **streams}
    monkeypatch.setattr(phases.torch.cuda, "current_stream", lambda device=None: state["current"])
    return state


def runner(forward: FakeStream, event: FakeEvent | None) -> SimpleNamespace:
    return SimpleNamespace(forward_stream=forward, shared_read_done_event=event)


def test_inside_a_forward_the_published_read_done_event_moves_after_the_phase(
    calls: dict[str, Any],
) -> None:
    event = FakeEvent(calls["log"])
    fence_reads(runner(calls["forward"], event), torch.device("cpu"))
    assert calls["log"] == [("record", "forward")]  # no host sync


def test_inside_a_forward_with_no_event_the_whole_forward_fence_already_holds(
    calls: dict[str, Any],
) -> None:
    fence_reads(runner(calls["forward"], None), torch.device("cpu"))
    assert calls["log"] == []


def test_outside_a_forward_the_schedule_stream_waits_for_the_forward_stream(
    calls: dict[str, Any],
) -> None:
    calls["current"] = calls["schedule"]
    fence_reads(runner(calls["forward"], FakeEvent(calls["log"])), torch.device("cpu"))
    assert calls["log"] == [("wait_stream", "schedule", "forward")]


def test_without_a_runner_the_stream_is_synchronized(calls: dict[str, Any]) -> None:
    fence_reads(None, torch.device("cpu"))
    assert calls["log"] == [("synchronize", "forward")]


def test_the_fake_runner_has_the_attributes_sglangs_barrier_reads() -> None:
    init = inspect.getsource(ModelRunner.__init__)
    assert "self.forward_stream = " in init
    assert "self.shared_read_done_event: Optional[torch.cuda.Event] = None" in init
    # The worker names its own runner as the one whose event the barrier waits on.
    assert "return self.model_runner" in inspect.getsource(
        TpModelWorker.last_shared_read_runner.fget  # type: ignore[attr-defined]
    )
    barrier = inspect.getsource(Scheduler._apply_war_barrier)
    assert "runner = self.model_worker.last_shared_read_runner" in barrier
    assert "ev = runner.shared_read_done_event" in barrier
    assert "self.schedule_stream.wait_event(ev)" in barrier
    assert "self.schedule_stream.wait_stream(self.forward_stream)" in barrier
    # Applied after each launched batch, before the next one is prepared.
    loop = inspect.getsource(Scheduler.event_loop_overlap)
    launch = loop.index("batch_result = self.run_batch(batch)")
    assert loop.index("self._apply_war_barrier()", launch) > launch
