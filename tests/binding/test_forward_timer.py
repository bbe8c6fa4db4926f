"""``forward_timer``: each forward's seconds, the forward and its requests go to its kind's
series, also when it raises; the forward's arguments and result pass through unchanged.
Run in a subprocess: Prometheus names are global to a process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_pic.binding.forward_timer import MODES

SCRIPT = """
from types import SimpleNamespace
from sgl_pic.binding.forward_timer import MODES, ForwardTimer, mode_of

timer = ForwardTimer()
timed_forward, seconds_counter, count_counters = (
    timer.timed_forward, timer.seconds_counter, timer.count_counters,
)

class Mode:
    def __init__(self, name):
        self.name = name
    def is_decode(self):
        return self.name == "DECODE"
    def is_mixed(self):
        return self.name == "MIXED"
    def is_extend(self):
        return self.name in ("EXTEND", "MIXED")

def batch(name, size=1):
    return SimpleNamespace(forward_mode=Mode(name), batch_size=size)

def seconds():
    return {m: seconds_counter().labels(mode=m)._value.get() for m in MODES}

def counts():
    c = count_counters()
    return [
        (m, c.forwards.labels(mode=m)._value.get(), c.requests.labels(mode=m)._value.get())
        for m in MODES
    ]

print([mode_of(batch(n)) for n in ("EXTEND", "MIXED", "DECODE", "IDLE")], mode_of(object()))
calls = []
def forward(runner, fb, *args, **kw):
    calls.append((runner, fb, args, kw))
    return "out"
fb = batch("DECODE", 3)
assert seconds() == {m: 0.0 for m in MODES}
print(counts())
print(timed_forward(forward, "runner", fb, 1, split_forward_count=2))
print(calls == [("runner", fb, (1,), {"split_forward_count": 2})])
timed_forward(forward, "runner", batch("DECODE", 2))
after_decode = seconds()
print(after_decode["decode"] > 0, [after_decode[m] for m in ("extend", "mixed", "other")])
def failing(runner, fb):
    raise ValueError("boom")
try:
    timed_forward(failing, "runner", forward_batch=batch("EXTEND", 4))
except ValueError as e:
    print("raised", e)
after = seconds()
same = seconds_counter() is seconds_counter()
print(after["extend"] > 0, after["decode"] == after_decode["decode"], same)
print(counts())
"""


def test_seconds_go_to_the_forward_kind() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        "['extend', 'mixed', 'decode', 'other'] other",
        str([(m, 0.0, 0.0) for m in MODES]),
        "out",
        "True",
        "True [0.0, 0.0, 0.0]",
        "raised boom",
        "True True True",
        # Two decode steps of 3 and 2 requests; the extend that raised, of 4.
        str([("extend", 1.0, 4.0), ("mixed", 0.0, 0.0), ("decode", 2.0, 5.0), ("other", 0.0, 0.0)]),
    ]


FAILING_METRIC_SCRIPT = """
from types import SimpleNamespace
from sgl_pic.binding import forward_timer

class Broken:
    def labels(self, **kw):
        raise OSError("no space left on device")

timer = forward_timer.ForwardTimer()
timer._seconds = Broken()
fb = SimpleNamespace(forward_mode=None)
print(timer.timed_forward(lambda runner, fb: "out", "runner", fb))
print(timer.timed_forward(lambda runner, fb: "again", "runner", fb))
"""


def test_a_metric_that_cannot_be_written_does_not_stop_the_forward() -> None:
    out = subprocess.run(
        [sys.executable, "-c", FAILING_METRIC_SCRIPT], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["out", "again"]
    # Logged once, not at every forward.
    assert out.stderr.count("forward seconds not counted") == 1, out.stderr


REGISTERED_SCRIPT = """
from sgl_pic.binding.cpu_env import activate_cpu_stubs
activate_cpu_stubs()
from sglang.srt.plugins.hook_registry import HookRegistry
from sgl_pic.binding import forward_timer, plugin

plugin.register()
plugin.register()  # idempotent: one timer, one hook
hooks = [h for _t, h, _s in HookRegistry._hooks[forward_timer.FORWARD_TARGET]]
print(len(hooks), type(hooks[0].__self__).__name__)
print(sorted(k for k in vars(forward_timer) if k.startswith("_") and not k.startswith("__")))
"""


@pytest.mark.sglang
def test_the_registry_holds_the_one_timer_of_the_process() -> None:
    """The timer's counters live on the instance the registry holds, not in module state."""
    out = subprocess.run([sys.executable, "-c", REGISTERED_SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1 ForwardTimer", "['_mode_counter']"]
