"""A server of ``python -m sgl_pic.launch_server`` in its own process group, for tests.

SGLang SIGKILLs its parent when a child fails, so the server never runs in the test
process; it is started with ``start_new_session`` and its whole group is ended by its id.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests

STARTUP_TIMEOUT_S = 420.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


@contextmanager
def launch(*args: str, preexec: Any = None) -> Iterator[Server]:
    """A healthy server with ``args``; unless they name one, its disk tier is a fresh
    temporary directory, so no test sees chunks another test (or a user) cached."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="sgl_pic_server_", suffix=".log")
    cmd = [sys.executable, "-m", "sgl_pic.launch_server", "--port", str(port), *args]
    if "--pic-disk-cache-dir" not in args:
        cmd += ["--pic-disk-cache-dir", tempfile.mkdtemp(prefix="sgl_pic_disk_")]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec
        )
    server = Server(f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if requests.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not healthy in {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}"
                )
            time.sleep(2)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
