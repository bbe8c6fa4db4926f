"""Resource series of the soak (``bench/soak.py``), sampled every few seconds per server:
resident memory, open file descriptors and threads of its whole process group (/proc),
SGLang's KV pool use and sgl-pic's chunk-node slots and host/disk tier bytes (/metrics),
the disk tier's bytes on disk; the shared store's processes likewise. After warm-up each
series' slope and last value against its first tell whether anything grows.

``parse_metrics``, ``group_sums`` and ``trend`` are pure; ``Sampler`` reads /proc and the
servers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import requests

PAGE = os.sysconf("SC_PAGE_SIZE")
# /metrics series sampled: the name in the sample <- the exported series, summed over its
# labels (SGLang labels by model and rank; sgl-pic's per-namespace gauges by namespace).
METRIC_SERIES = {
    "kv_token_usage": "sglang:token_usage",
    "kv_used_tokens": "sglang:num_used_tokens",
    "running_reqs": "sglang:num_running_reqs",
    "queued_reqs": "sglang:num_queue_reqs",
    "chunk_node_tokens": "sgl_pic_chunk_node_tokens",
}
# sgl_pic_namespace_tier_bytes (with --pic-namespace-metrics) by its tier label.
TIER_BYTES = "sgl_pic_namespace_tier_bytes"
TIERS = ("host", "disk")
# Series that must not grow after warm-up (the rest follow the load and are reported).
BOUNDED = (
    "rss_bytes",
    "max_process_rss_bytes",
    "fds",
    "threads",
    "chunk_node_tokens",
    "host_tier_bytes",
    "disk_tier_bytes",
    "disk_dir_bytes",
)
GROWTH_LIMIT = 0.05
# Series bounded by a configured cap (chunk-node slots, tier sizes): they fill after
# warm-up and must never pass their cap. The other bounded series are judged from the
# moment every capped series of their server first stood at FULL of its cap (the caches
# full: what filling them costs, such as pool pages first touched, is bounded by the
# caps), or from warm-up when the caches never filled.
CAPPED = ("chunk_node_tokens", "host_tier_bytes", "disk_tier_bytes", "disk_dir_bytes")
FULL = 0.95


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: series (name with labels) -> value; comments and histogram
    buckets left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_bucket{" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def label(series: str, key: str) -> str | None:
    """The value of label ``key`` in a series name like ``n{a="x",key="y"}``."""
    inner = series.partition("{")[2].rstrip("}")
    for part in inner.split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return v.strip().strip('"')
    return None


def group_sums(metrics: Mapping[str, float]) -> dict[str, float]:
    """The sampled values of one /metrics reading (a series absent reads as absent)."""
    out: dict[str, float] = {}
    for name, exported in METRIC_SERIES.items():
        found = [v for k, v in metrics.items() if k == exported or k.startswith(exported + "{")]
        if found:
            out[name] = sum(found)
    for tier in TIERS:
        found = [
            v
            for k, v in metrics.items()
            if k.startswith(TIER_BYTES + "{") and label(k, "tier") == tier
        ]
        out[f"{tier}_tier_bytes"] = sum(found)
    return out


class Trend(NamedTuple):
    """A series after warm-up: ``slope_per_min`` by least squares; ``growth``: last over
    first minus 1 (None when the first is 0); ``grows``: for a series with a ``cap``,
    whether it ever passed the cap; for another series in ``BOUNDED``, growth over
    ``GROWTH_LIMIT`` from ``since_t`` (from 0 to more counts as growth) with an upward
    slope."""

    n: int
    first: float
    last: float
    slope_per_min: float
    growth: float | None
    grows: bool
    cap: float | None = None
    since_t: float | None = None


def trend(
    points: Sequence[tuple[float, float]],
    bounded: bool,
    cap: float | None = None,
    since_t: float | None = None,
) -> Trend | None:
    """The trend of (t seconds, value) points (those from ``since_t`` on, when given),
    None with fewer than two."""
    if since_t is not None:
        points = [p for p in points if p[0] >= since_t]
    if len(points) < 2:
        return None
    ts = [p[0] for p in points]
    vs = [p[1] for p in points]
    mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / var if var else 0.0
    first, last = vs[0], vs[-1]
    growth = None if first == 0 else last / first - 1
    if cap is not None:
        grows = max(vs) > cap
    else:
        # Growth is a rise: over the limit from the first sample to the last, along an
        # upward least-squares slope (a step at the start that settles lower is not).
        rose = growth > GROWTH_LIMIT if growth is not None else last > 0
        grows = bounded and rose and slope > 0
    return Trend(len(points), first, last, slope * 60, growth, grows, cap, since_t)


def caches_full_at(
    per: Mapping[str, Sequence[tuple[float, float]]], caps: Mapping[str, float]
) -> float | None:
    """When every capped series in ``per`` had stood at ``FULL`` of its cap (each at its
    first such sample), None if one never did or none is capped."""
    times = []
    for name, cap in caps.items():
        points = per.get(name)
        if not points:
            continue
        t = next((t for t, v in points if v >= FULL * cap), None)
        if t is None:
            return None
        times.append(t)
    return max(times) if times else None


class Sample(NamedTuple):
    t: float  # seconds since the run began
    source: str  # a server's name, or "store"
    generation: int  # the server's launch (1, 2 after a restart, ...)
    values: dict[str, float]


def trends(
    samples: Iterable[Sample],
    starts: Mapping[tuple[str, int], float],
    warmup_s: float,
    caps: Mapping[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per source and launch (``source#generation``) and series: the trend of the samples
    ``warmup_s`` or more after that launch began serving (``starts``: when). ``caps``:
    the configured cap of each series in ``CAPPED`` (the servers'; absent: judged as any
    bounded series)."""
    caps = dict(caps or {})
    points: dict[tuple[str, int], dict[str, list[tuple[float, float]]]] = {}
    for s in samples:
        begun = starts.get((s.source, s.generation))
        if begun is None or s.t < begun + warmup_s:
            continue
        per = points.setdefault((s.source, s.generation), {})
        for k, v in s.values.items():
            per.setdefault(k, []).append((s.t, v))
    out: dict[str, dict[str, Any]] = {}
    for (source, gen), per in sorted(points.items()):
        full = caches_full_at(per, caps)
        found = {
            k: trend(p, k in BOUNDED, caps.get(k), None if k in caps else full)
            for k, p in sorted(per.items())
        }
        out[f"{source}#{gen}"] = {k: t._asdict() for k, t in found.items() if t is not None}
    return out


def _stat(pid: str) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def group_pids(pgid: int) -> list[int]:
    """The live processes of group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = _stat(entry)
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def process_group(pgid: int) -> dict[str, float]:
    """RSS (summed, and the largest process's), open fds and threads of every process in
    group ``pgid``; {} when none is left."""
    rss, biggest, fds, threads, procs = 0, 0, 0, 0, 0
    for entry in map(str, group_pids(pgid)):
        try:
            fields = _stat(entry)
            with open(f"/proc/{entry}/statm") as f:
                resident = int(f.read().split()[1]) * PAGE
            n_fds = len(os.listdir(f"/proc/{entry}/fd"))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        procs += 1
        rss += resident
        biggest = max(biggest, resident)
        fds += n_fds
        threads += int(fields[17])
    if not procs:
        return {}
    return {
        "processes": procs,
        "rss_bytes": rss,
        "max_process_rss_bytes": biggest,
        "fds": fds,
        "threads": threads,
    }


def dir_bytes(root: Path) -> float:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return float(total)


class Target(NamedTuple):
    """What is sampled of one source: its process group, /metrics URL and disk tier
    (each None when it has none or is down), and its launch."""

    source: str
    pgid: int | None
    url: str | None
    disk: Path | None
    generation: int


class Sampler:
    """A thread that samples ``targets()`` every ``every`` seconds until stopped."""

    def __init__(
        self, targets: Callable[[], list[Target]], now: Callable[[], float], every: float
    ) -> None:
        self.targets = targets
        self.now = now
        self.every = every
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample_once(self) -> None:
        for target in self.targets():
            values: dict[str, float] = {}
            if target.pgid is not None:
                values.update(process_group(target.pgid))
            if target.url is not None:
                try:
                    text = requests.get(target.url + "/metrics", timeout=10).text
                    values.update(group_sums(parse_metrics(text)))
                except requests.RequestException as e:
                    self.errors.append(f"{self.now():.1f} {target.source}: {e}"[:300])
            if target.disk is not None:
                values["disk_dir_bytes"] = dir_bytes(target.disk)
            if values:
                self.samples.append(Sample(self.now(), target.source, target.generation, values))

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.every - (time.monotonic() - t0)))
