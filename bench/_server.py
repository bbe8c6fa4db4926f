"""Shared helpers of the serving benchmarks: launch ``python -m sgl_pic.launch_server`` in
its own process group, talk to it over HTTP, and give each request a fresh header.

The server runs in its own process group (``sgl_pic.cli.server_process``): SGLang SIGKILLs its
parent when a child fails.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from _common import ROOT, server_env

STARTUP_TIMEOUT_S = 900.0
_PREFILL = re.compile(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)")
_PHASES = re.compile(r"assemble\+phase 1 ([0-9.]+) s, select\+phase 2 ([0-9.]+) s")


class Client:
    """HTTP access to one server. ``log_path`` is its log when this process launched it
    (then the executor's per-batch phase timings can be read from it), else None."""

    def __init__(self, url: str, log_path: str | None = None, pgid: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.pgid = pgid  # the server's process group, when this process launched it
        self._log_offset = 0
        self.skip_log()

    def generate(self, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """(client-side latency in seconds, response JSON) of one /generate request."""
        t0 = time.perf_counter()
        r = requests.post(self.url + "/generate", json=body, timeout=900)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:500]}")
        return dt, r.json()

    def flush(self, attempts: int = 20) -> None:
        """SGLang's /flush_cache (radix tree and chunk nodes; host and disk tiers stay).
        SGLang refuses while a request is still finishing, so it is retried briefly."""
        for _ in range(attempts):
            r = requests.post(self.url + "/flush_cache", timeout=120)
            if r.status_code == 200:
                return
            time.sleep(0.25)
        raise RuntimeError(f"/flush_cache kept failing: {r.status_code} {r.text[:200]}")

    def metrics(self) -> dict[str, float]:
        """sgl_pic_* series of /metrics, keyed by name with labels (buckets left out)."""
        out: dict[str, float] = {}
        for line in requests.get(self.url + "/metrics", timeout=60).text.splitlines():
            if line.startswith("sgl_pic") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def skip_log(self) -> None:
        """Forget log lines written so far (the next ``phase_timings`` reads newer ones)."""
        if self.log_path is not None:
            self._log_offset = os.path.getsize(self.log_path)

    def phase_timings(self) -> list[tuple[float, float]]:
        """(assemble + phase 1, select + phase 2) seconds of each chunked batch the
        executor logged since the last call; empty without a log."""
        if self.log_path is None:
            return []
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_offset)
            text = f.read()
            self._log_offset = f.tell()
        return [(float(a), float(b)) for a, b in _PHASES.findall(text)]

    def pause(self) -> None:
        """Stops the server's processes (SIGSTOP to its group): an idle SGLang scheduler
        polls for requests without sleeping, and on 2 cores that would slow whichever
        server is running; with ``--sleep-on-idle`` instead (a one-second idle poll), a
        stopped trial's blocks ran far longer than paused ones."""
        if self.pgid is None:
            raise RuntimeError("only a server this process launched can be paused")
        os.killpg(self.pgid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.pgid is None:
            raise RuntimeError("only a server this process launched can be resumed")
        os.killpg(self.pgid, signal.SIGCONT)

    def prefill_batches(self) -> tuple[int, int]:
        """(extend batches, their new tokens) SGLang's scheduler logged ("Prefill batch"
        lines) since the last ``skip_log``; (0, 0) without a log. The batches as SGLang
        formed them: sgl-pic's phase forwards split each chunked one further."""
        if self.log_path is None:
            return 0, 0
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_offset)
            found = _PREFILL.findall(f.read())
        return len(found), sum(int(n) for n in found)

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None:
            return "(no log: the server was not launched here)"
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """The value of series ``name`` with exactly ``labels`` (0.0 if absent)."""
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        key = f"{name}{{{inner}}}"
        if key in m:
            return m[key]
        # Label order as the exporter wrote it.
        want = {f'{k}="{v}"' for k, v in labels.items()}
        for k, v in m.items():
            if k.startswith(name + "{") and set(k[len(name) + 1 : -1].split(",")) == want:
                return v
        return 0.0
    return m.get(name, 0.0)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def fresh_header(tokenizer: Any) -> list[int]:
    """Token ids of a short unique line, tokenized on its own: prepended outside every
    chunk, it makes the request miss SGLang's prefix tree (apart from a token or two of
    the random text it may share with an earlier header) without /flush_cache."""
    return list(tokenizer(f"{secrets.token_hex(6)} fresh\n", add_special_tokens=False)["input_ids"])


def shifted(spans: Sequence[Sequence[int]], offset: int) -> list[list[int]]:
    return [[int(s) + offset, int(e) + offset] for s, e in spans]


@contextmanager
def launch(
    args: Sequence[str],
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    env_extra: Mapping[str, str] | None = None,
    root: Path = ROOT,
    log_prefix: str = "sgl_pic_bench_server_",
    quiet: bool = False,
) -> Iterator[Client]:
    """A healthy server with ``args`` (sgl_pic and SGLang flags), killed on exit with its
    whole process group. Its log is a temporary file, kept (its path is printed unless
    ``quiet``). ``env_extra``: variables added to its environment (e.g. OMP_NUM_THREADS);
    ``root``: the checkout whose code it runs (another commit's worktree, say)."""
    from sgl_pic.cli.server_process import server_process

    env = server_env(root, dict(env_extra or {}))
    t0 = time.monotonic()
    if not quiet:
        print(f"launching: sgl_pic.launch_server {' '.join(args)}", flush=True)
    with server_process(
        args, startup_timeout_s, env=env, cwd=str(root), log_prefix=log_prefix
    ) as proc:
        if not quiet:
            print(
                f"  log: {proc.log_path}\n  healthy after {time.monotonic() - t0:.0f} s",
                flush=True,
            )
        yield Client(proc.url, proc.log_path, proc.pid)
