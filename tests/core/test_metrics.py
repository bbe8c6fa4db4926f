"""sgl_pic's Prometheus series (``sgl_pic.core.metrics``), each check in its own
process: Prometheus names are global, and PicMetrics registers them."""

from __future__ import annotations

import subprocess
import sys

EVICTIONS_SCRIPT = """
from sgl_pic.core.metrics import PicMetrics
m = PicMetrics()
m.record_evictions({"device": 3, "host": 0})
m.record_evictions({"device": 5, "host": 2, "disk": 1})
m.record_evictions({"device": 5, "host": 2, "disk": 1})  # nothing new
print(*(m.evictions.labels(tier=t)._value.get() for t in ("device", "host", "disk")))
m.record_store_errors({"corrupt": 2})
m.record_store_errors({"corrupt": 3, "enospc": 1})
print(*(m.store_errors.labels(kind=k)._value.get() for k in ("corrupt", "enospc")))
"""


def test_evictions_and_store_errors_add_what_each_count_gained() -> None:
    out = subprocess.run(
        [sys.executable, "-c", EVICTIONS_SCRIPT], capture_output=True, text=True, check=True
    )
    evictions, errors = out.stdout.splitlines()
    assert evictions.split() == ["5.0", "2.0", "1.0"]
    assert errors.split() == ["3.0", "1.0"]
