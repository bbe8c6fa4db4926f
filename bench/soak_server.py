"""The servers under soak (``bench/soak.py``): each launched through
``sgl_pic.cli.server_process`` in its own process group, killed with SIGKILL on request,
restarted on the same arguments (and so the same disk tier); and a scan of a disk tier
with the project's record reader."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import requests
from _common import ROOT, server_env
from _server import STARTUP_TIMEOUT_S


class ServerEvent(NamedTuple):
    t: float
    server: str
    what: str  # started | killed | crashed | restart_failed | stopped
    detail: str


CAPACITY_LINE = re.compile(r"chunk nodes up to (\d+) of \d+ pool slots")


class ServerManager:
    """One server: ``name`` (a, b), its launch ``args``, its disk tier ``disk`` (None:
    none), ``env`` added to its environment. ``up`` is set while a healthy server is
    serving ``url``; ``generation`` counts its launches; ``started_at`` says when each
    launch began serving."""

    def __init__(
        self,
        name: str,
        args: list[str],
        disk: Path | None,
        now: Callable[[], float],
        events: list[ServerEvent],
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.env = dict(env or {})
        self.args = args
        self.disk = disk
        self._now = now
        self._events = events
        self._lock = threading.Lock()
        # Held across a kill and restart, so the crash watcher never mistakes the planned
        # kill for a crash, nor restarts a server the main thread is restarting.
        self.lifecycle = threading.RLock()
        self.restart_failures = 0
        self._stack: ExitStack | None = None
        self.url = ""
        self.pid = 0
        self.log_paths: list[str] = []
        self.generation = 0
        self.started_at: dict[int, float] = {}
        self.up = threading.Event()
        self.planned_outage = False

    def start(self) -> None:
        from sgl_pic.cli.server_process import server_process

        stack = ExitStack()
        t0 = time.monotonic()
        proc = stack.enter_context(
            server_process(
                self.args,
                STARTUP_TIMEOUT_S,
                env=server_env(extra=self.env),
                cwd=str(ROOT),
                log_prefix=f"sgl_pic_soak_{self.name}_",
            )
        )
        with self._lock:
            self._stack = stack
            self.url, self.pid = proc.url, proc.pid
            self.log_paths.append(proc.log_path)
            self.generation += 1
            self.started_at[self.generation] = self._now()
            self.planned_outage = False
        self.event("started", f"{proc.url} pid {proc.pid} in {time.monotonic() - t0:.0f} s")
        self.up.set()

    def restart(self) -> bool:
        """start(), recording a failure instead of raising: the run goes on (its clients
        count the outage) and the failure is reported."""
        try:
            self.start()
        except RuntimeError as e:
            self.restart_failures += 1
            self.event("restart_failed", str(e)[-2000:])
            return False
        return True

    def event(self, what: str, detail: str) -> None:
        t = self._now()
        self._events.append(ServerEvent(round(t, 2), self.name, what, detail))
        print(f"[{t:7.1f} s] server {self.name} {what}: {detail}", flush=True)

    def alive(self) -> bool:
        """Whether the server's main process still runs (a zombie does not)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def kill9(self, planned: bool = True) -> None:
        """SIGKILL to the whole process group, then wait until its leader is gone."""
        with self._lock:
            self.planned_outage = planned
            self.up.clear()
            pid = self.pid
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._close()

    def _close(self) -> None:
        with self._lock:
            stack, self._stack = self._stack, None
        if stack is not None:
            # Reaps the leader; SIGTERMs the group if anything is left of it.
            with suppress(OSError):
                stack.close()

    def stop(self) -> None:
        """Ends the server (SIGTERM to its group); once: a second call does nothing."""
        running = self._stack is not None
        self.up.clear()
        self._close()
        if running:
            self.event("stopped", "end of run")

    def log_tail(self, n: int = 40) -> str:
        from sgl_pic.cli.server_process import log_tail

        return log_tail(self.log_paths[-1], n) if self.log_paths else ""

    def metrics(self, prefixes: tuple[str, ...] = ("sgl_pic_",)) -> dict[str, float]:
        """Series of /metrics whose names start with one of ``prefixes`` (buckets left
        out); raises requests.RequestException when it cannot be read."""
        from soak_sampler import parse_metrics

        text = requests.get(self.url + "/metrics", timeout=60).text
        return {k: v for k, v in parse_metrics(text).items() if k.startswith(prefixes)}

    def chunk_capacity(self) -> int | None:
        """Chunk-node slots this server's start-up line reports ("chunk nodes up to N of
        M pool slots"), None when its log has none."""
        for path in self.log_paths:
            with open(path, errors="replace") as f:
                for line in f:
                    m = CAPACITY_LINE.search(line)
                    if m:
                        return int(m.group(1))
        return None

    def server_info(self) -> dict[str, Any]:
        r = requests.get(self.url + "/get_server_info", timeout=60)
        r.raise_for_status()
        return dict(r.json())


@dataclass(frozen=True)
class DiskScan:
    """A pass over a disk tier: every record file read whole through the project's own
    reader (prefix, header checksum, key against the file name, every payload block)."""

    t: float
    files: int
    valid: frozenset[str]  # file names whose record passed every check
    bad: dict[str, str]  # file name -> error class and message
    tmp_files: tuple[str, ...]  # write temp files (left by a killed writer)
    seconds: float

    def summary(self) -> dict[str, Any]:
        kinds = Counter(v.split(":", 1)[0] for v in self.bad.values())
        return {
            "t": round(self.t, 2),
            "files": self.files,
            "valid": len(self.valid),
            "bad": len(self.bad),
            "bad_by_kind": dict(kinds),
            "bad_files": dict(sorted(self.bad.items())[:20]),
            "tmp_files": len(self.tmp_files),
            "seconds": round(self.seconds, 2),
        }


def scan_disk(root: Path, t: float) -> DiskScan:
    from sgl_pic.store.errors import StoreError
    from sgl_pic.store.format import SUFFIX, TMP_PREFIX, RecordFile

    t0 = time.monotonic()
    valid: set[str] = set()
    bad: dict[str, str] = {}
    tmp: list[str] = []
    files = 0
    for path in sorted(root.rglob("*")) if root.exists() else []:
        if not path.is_file():
            continue
        if path.name.startswith(TMP_PREFIX):
            tmp.append(str(path.relative_to(root)))
            continue
        if not path.name.endswith(SUFFIX):
            continue
        files += 1
        name = str(path.relative_to(root))
        key = path.name[: -len(SUFFIX)]
        try:
            if path.parent.name != key[:2]:
                raise ValueError(f"in directory {path.parent.name}, not {key[:2]}")
            with RecordFile(path, key=key) as f:
                f.read_record()  # verifies every payload block
            valid.add(name)
        except (StoreError, OSError, ValueError) as e:
            bad[name] = f"{type(e).__name__}: {e}"
    return DiskScan(t, files, frozenset(valid), bad, tuple(tmp), time.monotonic() - t0)
