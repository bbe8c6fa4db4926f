"""A server of ``python -m sgl_pic.launch_server`` for tests (``sgl_pic.cli.server_process``
runs it in its own process group), and HTTP helpers over it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import requests

from sgl_pic.cli.server_process import log_tail, server_process
from sgl_pic.core.metric_series import declared_series

STARTUP_TIMEOUT_S = 420.0


# The series PicMetrics declares, read from their declarations (no Prometheus object is
# made): a series absent from /metrics reads 0 only if it is one of these, so a misspelt
# name fails the test instead of reading 0.
DECLARED = frozenset(series.name for _, series in declared_series())
assert "sgl_pic_phase_forwards" in DECLARED, "the metric declarations moved: read them here"


class MetricDeltas(dict[str, float]):
    """How much each sgl_pic_* series moved; a declared series that never appeared moved
    by 0."""

    def __missing__(self, key: str) -> float:
        family = key.split("{", 1)[0]
        if family.removesuffix("_total") in DECLARED or family in DECLARED:
            return 0.0
        raise KeyError(key)


class Sent(NamedTuple):
    """out: the /generate response JSON. delta: what the request moved in /metrics."""

    out: dict[str, Any]
    delta: MetricDeltas


class Server:
    def __init__(self, url: str, log_path: str) -> None:
        self.url = url
        self.log_path = log_path

    def generate(self, body: dict[str, Any]) -> requests.Response:
        return requests.post(self.url + "/generate", json=body, timeout=300)

    def send(self, body: dict[str, Any]) -> Sent:
        """One /generate request that must answer 200, and the metrics it moved (the
        server serves one test at a time, so nothing else moves them meanwhile)."""
        before = self.metrics()
        r = self.generate(body)
        assert r.status_code == 200, r.text
        after = self.metrics()
        moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in before.keys() | after.keys()}
        return Sent(r.json(), MetricDeltas(moved))

    def metrics(self) -> dict[str, float]:
        """sgl_pic_* series of /metrics (histogram buckets left out)."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("sgl_pic") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)


@contextmanager
def launch(*args: str, preexec: Any = None) -> Iterator[Server]:
    """A healthy server with ``args``; unless they name one, its disk tier is a fresh
    temporary directory, so no test sees chunks another test (or a user) cached, and it
    stores every missed chunk (``--pic-admission always``): tests of what a miss does must
    not depend on how many novel chunks the tests before them sent, which adaptive
    admission reads (it has tests of its own, ``test_admission.py``)."""
    extra = (
        []
        if "--pic-disk-cache-dir" in args
        else ["--pic-disk-cache-dir", tempfile.mkdtemp(prefix="sgl_pic_disk_")]
    )
    if "--pic-admission" not in args:
        extra += ["--pic-admission", "always"]
    with server_process([*args, *extra], STARTUP_TIMEOUT_S, preexec) as proc:
        yield Server(proc.url, proc.log_path)
