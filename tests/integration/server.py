"""A server of ``python -m sgl_pic.launch_server`` for tests (``sgl_pic.server_process``
runs it in its own process group), and HTTP helpers over it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests

from sgl_pic.server_process import log_tail, server_process

STARTUP_TIMEOUT_S = 420.0


class Server:
    def __init__(self, url: str, log_path: str) -> None:
        self.url = url
        self.log_path = log_path

    def generate(self, body: dict[str, Any]) -> requests.Response:
        return requests.post(self.url + "/generate", json=body, timeout=300)

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
