"""Run ``python -m sgl_pic.launch_server`` as a child in its own process group.

SGLang SIGKILLs its parent when one of its own children fails, so a program that starts a
server for a while (tests, benchmarks) must not be that parent's process group: the
server starts with ``start_new_session`` and its whole group is ended by its id.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import requests


class ServerProcess(NamedTuple):
    url: str  # http://127.0.0.1:PORT
    log_path: str  # the server's stdout and stderr
    pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(log_path: str, n: int = 60) -> str:
    with open(log_path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


@contextmanager
def server_process(
    args: Sequence[str],
    startup_timeout_s: float = 600.0,
    preexec: Callable[[], None] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    log_prefix: str = "sgl_pic_server_",
    module: str = "sgl_pic.launch_server",
) -> Iterator[ServerProcess]:
    """A server with ``args`` (SGLang and --pic-* flags) answering /health, killed with its
    process group on exit. Raises RuntimeError with the log's tail if it exits or is not
    healthy in time. ``preexec`` runs in the child before exec (e.g. resource limits);
    ``module`` is the launcher run (``sglang.launch_server`` for SGLang's own)."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
            env=None if env is None else dict(env),
            cwd=cwd,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail(log_path)}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not healthy in {startup_timeout_s}s:\n{log_tail(log_path)}"
                )
            time.sleep(2)
        yield ServerProcess(url, log_path, proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
