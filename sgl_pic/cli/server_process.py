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


# A port free when chosen can be taken before the server binds it; SGLang's launcher then
# logs the bind error and stays up without an HTTP server, so it is started again on
# another port rather than waited on until the timeout.
PORT_TRIES = 3


def _port_taken(log_path: str, port: int) -> bool:
    text = log_tail(log_path, 200)
    return "address already in use" in text and f"'127.0.0.1', {port})" in text


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
    healthy in time; a port taken before the server bound it is replaced (``PORT_TRIES``).
    ``preexec`` runs in the child before exec (e.g. resource limits); ``module`` is the
    launcher run (``sglang.launch_server`` for SGLang's own)."""
    deadline = time.monotonic() + startup_timeout_s
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        proc, log_path = _launch(
            [module, "--port", str(port), *args], log_prefix, preexec, env, cwd
        )
        url = f"http://127.0.0.1:{port}"
        try:
            taken = _wait_healthy(
                proc, url, log_path, port, deadline, startup_timeout_s, attempt < PORT_TRIES
            )
        except BaseException:
            _stop(proc)
            raise
        if taken:
            _stop(proc)
            continue
        try:
            yield ServerProcess(url, log_path, proc.pid)
        finally:
            _stop(proc)
        return


def _launch(
    module_args: Sequence[str],
    log_prefix: str,
    preexec: Callable[[], None] | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Starts ``python -m <module_args>`` in a new session, its stdout and stderr to a new
    temporary log; returns the process and the log's path."""
    fd, log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
    cmd = [sys.executable, "-m", *module_args]
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
    return proc, log_path


def _wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    log_path: str,
    port: int,
    deadline: float,
    startup_timeout_s: float,
    may_retry: bool,
) -> bool:
    """Polls ``url``/health until it answers 200 (False) or, where ``may_retry``, the log
    shows ``port`` was taken before the server bound it (True). Raises RuntimeError with
    the log's tail if the server exits or ``deadline`` (monotonic) passes; the caller
    stops the process."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return False
        except requests.RequestException:
            pass
        if may_retry and _port_taken(log_path, port):
            return True
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy in {startup_timeout_s}s:\n{log_tail(log_path)}")
        time.sleep(2)
