"""Starts and stops a shared chunk store on this machine: Mooncake Store's master (with
its HTTP metadata server) and one holder process that mounts the store's memory.

Servers join it with ``--pic-shared-store mooncake://HOST:PORT``. Ports used: PORT (master
RPC), PORT + 1 (metadata, HTTP), PORT + 2 (holder), PORT + 3 (master metrics, HTTP: its
``/metrics`` says when the holder's memory is mounted). The holder mounts no disk: the
store is memory, and a restart empties it (servers then recompute and store again).

``python -m sgl_pic.store.shared.service --port 50551 --memory-mb 2048`` runs it in the
foreground until SIGTERM/SIGINT (``scripts/shared_store.sh`` runs it in the background).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path


class ServiceError(RuntimeError):
    """The store's processes could not be found or started."""


@dataclass(frozen=True)
class ServiceConfig:
    """host:      address the store listens on and servers reach it by.
    port:       master RPC port (the others follow it, see the module docstring).
    memory_mb:  memory the holder mounts for objects, MiB.
    log_dir:    where the processes' logs go.
    """

    host: str = "127.0.0.1"
    port: int = 50551
    memory_mb: int = 1024
    log_dir: str = "/tmp/sgl_pic_shared_store"

    def __post_init__(self) -> None:
        if not 1024 <= self.port <= 65532:
            raise ValueError(f"port must be in [1024, 65532], got {self.port}")
        if self.memory_mb < 16:
            raise ValueError(f"memory_mb must be >= 16, got {self.memory_mb}")

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.port}"


def binary(name: str) -> Path:
    """A Mooncake executable shipped inside its wheel. Raises ServiceError naming the
    package (and the system library it needs) when it is missing."""
    try:
        import mooncake
    except ImportError as exc:
        raise ServiceError(
            "the shared store needs mooncake-transfer-engine-non-cuda "
            "(bash scripts/install.sh installs it)"
        ) from exc
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise ServiceError(f"{path} is missing from the mooncake wheel")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


class SharedStoreService:
    """The two processes, each in its own process group. ``start`` waits until the
    holder's memory is mounted; ``stop`` ends both (SIGTERM, then SIGKILL); ``kill``
    ends them at once (fault tests)."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return self.config.url

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log_dir = Path(self.config.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            return subprocess.Popen(
                [str(binary(name)), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def start(self, timeout_s: float = 30.0) -> str:
        """Start both processes and return the store's URL once it takes objects."""
        c = self.config
        self._procs.append(
            self._spawn(
                "mooncake_master",
                [
                    f"--rpc_port={c.port}",
                    f"--rpc_address={c.host}",
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={c.host}",
                    f"--http_metadata_server_port={c.port + 1}",
                    f"--metrics_port={c.port + 3}",
                    "--rpc_thread_num=2",
                ],
            )
        )
        self._wait(lambda: self._metric("master_active_clients") is not None, timeout_s, "master")
        self._procs.append(
            self._spawn(
                "mooncake_client",
                [
                    f"--host={c.host}",
                    f"--port={c.port + 2}",
                    f"--global_segment_size={c.memory_mb}MB",
                    "--local_buffer_size=16MB",
                    f"--master_server_address={c.host}:{c.port}",
                    f"--metadata_server=http://{c.host}:{c.port + 1}/metadata",
                    "--protocol=tcp",
                ],
            )
        )
        self._wait(
            lambda: (self._metric("master_total_capacity_bytes") or 0) > 0, timeout_s, "holder"
        )
        return self.url

    def keys(self) -> list[str]:
        """Every key the store holds now (the master's admin endpoint; tools and tests)."""
        url = f"http://{self.config.host}:{self.config.port + 3}/get_all_keys"
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            return [k for k in resp.read().decode().split() if k]

    def _metric(self, name: str) -> float | None:
        url = f"http://{self.config.host}:{self.config.port + 3}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def _wait(self, ready: object, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    self.kill()
                    raise ServiceError(
                        f"shared store {what} exited with code {p.returncode}; "
                        f"see {self.config.log_dir}"
                    )
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.1)
        self.kill()
        raise ServiceError(f"shared store {what} not ready within {timeout_s} s")

    def _signal(self, sig: int) -> None:
        for p in self._procs:
            if p.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)

    def kill(self) -> None:
        """SIGKILL both at once: what a crash of the store's machine looks like."""
        self._signal(signal.SIGKILL)
        for p in self._procs:
            p.wait()
        self._procs.clear()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            with suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        self.kill()

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)


@contextmanager
def shared_store(config: ServiceConfig) -> Iterator[SharedStoreService]:
    """A started store, stopped on exit."""
    service = SharedStoreService(config)
    service.start()
    try:
        yield service
    finally:
        service.stop()


def main(argv: list[str] | None = None) -> None:
    d = ServiceConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--memory-mb", type=int, default=d.memory_mb)
    p.add_argument("--log-dir", default=d.log_dir)
    a = p.parse_args(argv)
    service = SharedStoreService(ServiceConfig(a.host, a.port, a.memory_mb, a.log_dir))
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    url = service.start()
    print(url, flush=True)
    while not stop and service.running:
        time.sleep(0.5)
    code = 0 if stop else 1  # a store process that died on its own is an error
    service.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
