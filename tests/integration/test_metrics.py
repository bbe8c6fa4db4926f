"""sgl_pic's Prometheus series (``sgl_pic.integration.metrics``), each check in its own
process: Prometheus names are global, and PicMetrics registers them."""

from __future__ import annotations

import subprocess
import sys

EVICTIONS_SCRIPT = """
from sgl_pic.integration.metrics import PicMetrics
m = PicMetrics()
m.record_evictions({"device": 3, "host": 0})
m.record_evictions({"device": 5, "host": 2, "disk": 1})
m.record_evictions({"device": 5, "host": 2, "disk": 1})  # nothing new
print(*(m.evictions.labels(tier=t)._value.get() for t in ("device", "host", "disk")))
"""


def test_evictions_add_what_each_tier_gained() -> None:
    out = subprocess.run(
        [sys.executable, "-c", EVICTIONS_SCRIPT], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["5.0", "2.0", "1.0"]
