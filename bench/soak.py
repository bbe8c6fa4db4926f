"""Soak: mixed traffic on two servers sharing a chunk store for many minutes, with faults
injected in windows, resources sampled, and every answer, window and series recorded.

    python bench/soak.py --find-concurrency --until-answered 1000   # the record run (idle)
    python bench/soak.py --smoke --out /tmp/soak.json      # the pipeline in ~3 minutes
    python bench/soak.py --clients 6 --minutes 20 --no-shared-store

It starts the shared store (Mooncake, ``sgl_pic.store.shared.service``) and two servers
(``python -m sgl_pic.launch_server``, each in its own process group) joined to it: server a
keeps its disk tier on a small tmpfs mounted for the run (``--disk-mb``), server b on a
temporary directory. Both get ``--chunked-prefill-size 512`` (the CPU default is 4096: the
long prompts then need far fewer passages to span several prefill pieces), a 256 MiB host
tier, per-namespace metrics (the host/disk tier bytes the sampler reads) and
``--pic-auto-chunk tool,document``, before ``--server-args``; each its share of the
machine's cores as its OpenMP team (``OMP_NUM_THREADS``: they stand for two machines).

Clients (``--clients``, or the ramp's choice with ``--find-concurrency``) send the mix of
``soak_traffic`` to either server at random, as one of ``--tenants`` tenants or none; a
canary (fixed greedy /generate with logprobs) runs on each server every ``--canary-every``
seconds against its cold-cache reference; the tenant probe (``soak_tenants``) counts
cross-tenant and deleted-chunk hits on server a. Faults (``soak_faults``), at fixed shares
of the run: a burst of ``--burst`` requests at once; a's disk filesystem filled and
emptied; the shared store killed and restarted; a killed with SIGKILL and restarted on its
disk tier, and records of that tier corrupted as soon as it serves again. The sampler
(``soak_sampler``) reads /proc and /metrics every ``--sample-every`` seconds.

Results: JSON (``--out``: commit, dirty flag, load average at start, concurrency, every
request, canary check, window, sample and the summary) and a plot of the series beside it
(``.png``). Exit status 1 when a check fails: a 5xx outside the kill window, a crash, a
failed restart, a canary mismatch or error, a window whose checks failed or whose servers
never served again, a record lost to the kill or served corrupt, a cross-tenant or
deleted-chunk hit, a failed tenant probe, or a bounded series grown over 5% after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from _common import add_data_option, add_out_option, add_server_args_option, git_state, write_json
from soak_faults import Faults
from soak_plot import plot
from soak_run import Soak
from soak_sampler import trends
from soak_server import DiskScan, ServerEvent, ServerManager, scan_disk
from soak_stats import format_table, kind_stats, totals
from soak_tenants import summarize as summarize_tenants
from soak_traffic import MIX, Traffic
from soak_windows import outside
from soak_windows import summarize as summarize_windows
from soak_workload import Workload

SERVER_DEFAULTS = [
    "--chunked-prefill-size",
    "512",
    "--pic-host-cache-mb",
    "256",
    "--pic-namespace-metrics",
    "8",
    "--pic-auto-chunk",
    "tool,document",
]
RAMP = [1, 2, 4, 8, 12, 16, 24, 32]
# --smoke: the pipeline end to end, every window, in minutes (a burst of 20, short
# passages), not a measurement.
SMOKE = {
    "minutes": 3.0,
    "warmup_minutes": 0.5,
    "pool": 16,
    "passage_tokens": 64,
    "burst": 20,
    "canary_every": 10.0,
    "tenant_probe_every": 60.0,
    "sample_every": 3.0,
    "hold": 8.0,
    "ramp_seconds": 20.0,
}


def options() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="traffic, at least")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument(
        "--until-answered",
        type=int,
        default=0,
        help="go on past --minutes until this many requests were answered after warm-up",
    )
    ap.add_argument("--max-minutes", type=float, default=180.0, help="cap of --until-answered")
    ap.add_argument("--smoke", action="store_true", help="short windows, about 3 minutes")
    ap.add_argument("--find-concurrency", action="store_true", help="ramp clients first")
    ap.add_argument("--ramp-seconds", type=float, default=60.0, help="per ramp level")
    ap.add_argument("--warmup-minutes", type=float, default=5.0, help="after each launch")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds")
    ap.add_argument("--hold", type=float, default=30.0, help="seconds a disk/store fault lasts")
    ap.add_argument("--burst", type=int, default=100, help="requests sent at once")
    ap.add_argument("--corrupt-share", type=float, default=0.1, help="of other disk records")
    ap.add_argument("--settle", type=float, default=15.0, help="traffic after the last fault")
    add_out_option(ap, "soak.json")
    add_data_option(ap)
    ap.add_argument("--pool", type=int, default=64, help="passages in the pool")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of popularity")
    ap.add_argument("--passage-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--canary-every", type=float, default=20.0, help="seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disk-mb", type=int, default=1024, help="server a's disk filesystem")
    ap.add_argument("--store-mb", type=int, default=1024, help="shared store memory")
    ap.add_argument("--no-shared-store", action="store_true", help="one server, no store")
    add_server_args_option(ap)
    ap.add_argument("--tenants", type=int, default=3, help="tenants (>= 2 probes them)")
    ap.add_argument("--tenant-probe-every", type=float, default=60.0, help="seconds")
    return ap


def mount_tmpfs(path: Path, mb: int) -> bool:
    """A tmpfs of ``mb`` MiB at ``path``; False where mounting is not permitted."""
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free (the shared store takes four)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65532:
            continue
        try:
            with ExitStack() as stack:
                for p in range(base, base + n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def probe_prompts(w: Workload, n: int) -> list[tuple[list[int], list[list[int]]]]:
    """``n`` prompts of two fresh chunks each (a tag nobody else sends), tokenized now."""
    out = []
    for i in range(n):
        ids, spans = list(w.system), [[0, len(w.system)]]
        for j in range(2):
            text = w.passages[(2 * i + j) % len(w.passages)].text
            c = w.ids(w.passage_template.format(text=f"[soak probe {i}.{j}] {text}"))
            spans.append([len(ids), len(ids) + len(c)])
            ids += c
        out.append((ids + w.tails[i % len(w.tails)], spans))
    return out


def summarize(
    soak: Soak,
    windows: list[dict[str, Any]],
    scans: dict[str, DiskScan],
    caps: dict[str, float],
) -> dict[str, Any]:
    tr = soak.traffic
    recs = tr.records
    seconds = max(1e-9, soak.clients_end_t - soak.clients_t)
    canary = Counter(c.outcome for c in soak.canary)
    trend = trends(soak.samples(), soak.starts(), soak.args.warmup_minutes * 60, caps)
    grown = {f"{src}/{k}": v for src, per in trend.items() for k, v in per.items() if v["grows"]}
    out = {
        **totals(recs),
        "answered_after_warmup": soak.answered_after_warmup(),
        "5xx_outside_kill": sum(
            r.outcome == "5xx" for r in outside(recs, soak.faults.windows, {"kill9"})
        ),
        "crashes": soak.crashes,
        "restart_failures": sum(s.restart_failures for s in soak.servers),
        "canary_checks": len(soak.canary),
        "canary_by_outcome": dict(canary),
        "canary_mismatches": canary["mismatch"],
        "canary_errors": canary["error"],
        "windows_failed": [w["name"] for w in windows if not w["ok"]],
        "disk": {k: s.summary() for k, s in scans.items()},
        "per_kind": {k: v._asdict() for k, v in kind_stats(recs, seconds).items()},
        "series_grown": grown,
        "sampler_errors": len(soak.sampler.errors),
        **({"tenants": summarize_tenants(soak.probes)} if soak.args.tenants >= 2 else {}),
    }
    return out


def failures(s: dict[str, Any]) -> list[str]:
    t = s.get("tenants", {})
    found = {
        "5xx outside the kill window": s["5xx_outside_kill"],
        "crashes": s["crashes"],
        "restart failures": s["restart_failures"],
        "canary mismatches": s["canary_mismatches"],
        "canary errors": s["canary_errors"],
        "windows failed": len(s["windows_failed"]),
        "cross-tenant hits": t.get("cross_tenant_hits", 0),
        "deleted-chunk hits": t.get("deleted_chunk_hits", 0),
        "tenant probe errors": t.get("probe_errors", 0),
        "series grown": len(s["series_grown"]),
    }
    return [f"{k}: {v}" for k, v in found.items() if v]


def print_summary(s: dict[str, Any], windows: list[dict[str, Any]], soak: Soak) -> None:
    print("\n=== soak summary ===")
    print(f"requests {s['requests']}  answered {s['answered']}  outcomes {s['by_outcome']}")
    print(f"answered after warm-up {s['answered_after_warmup']}  5xx {s['5xx']} ")
    print(f"crashes {s['crashes']}  canary {s['canary_by_outcome']}")
    if "tenants" in s:
        print(f"tenants: {json.dumps(s['tenants'])}")
    for w in windows:
        c = w["cost"]
        print(
            f"window {w['name']:10s} {w['start']:7.1f}-{w['end']} ok={w['ok']} sent {c['sent']} "
            f"failed {c['failed']} unavailable {c['unavailable']} serving again after "
            f"{c['serving_again_s']} s; checks {json.dumps(w['checks'], default=str)[:400]}"
        )
    print(format_table(soak_kind_stats(s)))
    for name, v in s["series_grown"].items():
        first, last, slope = v["first"], v["last"], v["slope_per_min"]
        print(f"GROWN {name}: first {first:.4g} last {last:.4g} slope/min {slope:.4g}")


def soak_kind_stats(s: dict[str, Any]) -> dict[str, Any]:
    from soak_stats import KindStats

    return {k: KindStats(**v) for k, v in s["per_kind"].items()}


def series_caps(server: ServerManager, disk_mb: int) -> dict[str, float]:
    """The caps the servers were given, for the sampled series they bound: chunk-node
    slots (as the server reports them at start-up), the host tier (``SERVER_DEFAULTS``)
    and the disk tier (its directory included)."""
    host_mb = int(SERVER_DEFAULTS[SERVER_DEFAULTS.index("--pic-host-cache-mb") + 1])
    caps = {
        "host_tier_bytes": float(host_mb * 2**20),
        "disk_tier_bytes": float(disk_mb * 2**20),
        "disk_dir_bytes": float(disk_mb * 2**20),
    }
    nodes = server.chunk_capacity()
    if nodes is not None:
        caps["chunk_node_tokens"] = float(nodes)
    return caps


def server_threads(servers: int) -> dict[str, str]:
    """Each server's share of this machine's cores as its OpenMP team: the servers stand
    for separate machines, and two servers spinning a team of every core each on the same
    cores slow every forward severalfold."""
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // servers))}


def main() -> int:
    ap = options()
    if ap.parse_args().smoke:
        ap.set_defaults(**SMOKE)  # flags given still win
    args = ap.parse_args()
    # SGLang's frontend warns with a traceback on every failed request while a server is
    # down; each is recorded already.
    warnings.filterwarnings("ignore", message="Error in stream_executor")
    # A SIGTERM ends the run as Ctrl-C does: the servers, the store and the mount go too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    commit, dirty = git_state()
    load = os.getloadavg()
    print(f"load average at start: {load}", flush=True)
    workload = Workload(Path(args.data), args.pool, args.passage_tokens, args.zipf, args.seed)
    probes = probe_prompts(workload, 8)
    t_begin = time.monotonic()

    def now() -> float:
        return time.monotonic() - t_begin

    with ExitStack() as stack:
        mount = Path(tempfile.mkdtemp(prefix="sgl_pic_soak_mnt_"))
        stack.callback(shutil.rmtree, mount, True)
        mounted = mount_tmpfs(mount, args.disk_mb)
        if mounted:
            stack.callback(subprocess.run, ["umount", "-l", str(mount)], check=False)
        print(f"disk tier of a on {'a tmpfs' if mounted else 'no mount (RLIMIT_FSIZE)'}")
        b_disk = Path(tempfile.mkdtemp(prefix="sgl_pic_soak_disk_b_"))
        stack.callback(shutil.rmtree, b_disk, True)
        (mount / "tier").mkdir()
        store, store_t = None, 0.0
        common = [*SERVER_DEFAULTS, "--pic-disk-cache-mb", str(args.disk_mb * 3 // 4)]
        if not args.no_shared_store:
            from sgl_pic.store.shared.service import ServiceConfig, SharedStoreService

            port = free_ports(4)
            logs = tempfile.mkdtemp(prefix="sgl_pic_soak_store_")
            store = SharedStoreService(
                ServiceConfig(port=port, memory_mb=args.store_mb, log_dir=logs)
            )
            store_t = now()
            store.start()
            stack.callback(store.stop)
            common += ["--pic-shared-store", store.url]
        common += shlex.split(args.server_args)
        events: list[ServerEvent] = []
        disks = [mount / "tier", b_disk][: 1 if store is None else 2]
        threads = server_threads(len(disks))
        servers = [
            ServerManager(name, [*common, "--pic-disk-cache-dir", str(d)], d, now, events, threads)
            for name, d in zip("ab", disks, strict=False)
        ]
        starters = [threading.Thread(target=s.start) for s in servers]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        for s in servers:
            stack.callback(s.stop)
            if not s.up.is_set():
                raise RuntimeError(f"server {s.name} did not start")
        traffic = Traffic(args, workload, servers, now)
        piece = int(servers[0].server_info().get("chunked_prefill_size") or 4096)
        caps = series_caps(servers[0], args.disk_mb * 3 // 4)
        traffic.long_passages = workload.passages_over(int(2.5 * piece))
        faults = Faults(traffic, mount if mounted else None, store, probes)
        if store is not None:
            faults.store_starts.append(store_t)
        soak = Soak(args, traffic, faults)
        soak.events = events
        for s in servers:
            soak.reference[s.name] = soak.send_canary(s)  # cold cache
        print(f"canary reference: {soak.reference}", flush=True)
        soak.sampler.start()
        clients = args.clients
        if args.find_concurrency:
            ramp = [n for n in RAMP if n <= 8] if args.smoke else RAMP
            clients = soak.find_concurrency(ramp, args.ramp_seconds).clients
        prepared: dict[str, Any] = {}

        def kill_and_corrupt() -> None:
            # The probe's records are on disk only, from its request before the kill to
            # the corruption right after the restart: no tier above holds them, and
            # the traffic has no time to evict them.
            prepared.update(faults.prepare_corruption())
            faults.kill9()
            faults.corrupt(prepared, args.corrupt_share)

        schedule = [
            (0.15, lambda: faults.burst(args.burst)),
            (0.25, lambda: faults.disk_full(args.hold)),
            *([(0.4, lambda: faults.store_kill(args.hold))] if store is not None else []),
            (0.6, kill_and_corrupt),
        ]
        soak.run(clients, args.minutes * 60, schedule)
        for s in servers:
            final = soak.check_canary(s)
            soak.canary.append(final)
            print(f"final canary {s.name}: {final.outcome} {final.detail}", flush=True)
        final_metrics = {}
        for s in servers:
            with suppress(Exception):
                final_metrics[s.name] = s.metrics()
        soak.sampler.stop()
        for s in servers:
            s.stop()
        faults.scans["end"] = scan_disk(mount / "tier", now())

    windows = summarize_windows(
        faults.windows, traffic.records, [(c.t, c.outcome) for c in soak.canary]
    )
    summary = summarize(soak, windows, faults.scans, caps)
    result = {
        "git_commit": commit,
        "git_dirty": dirty,
        "load_average_at_start": load,
        "disk_on_tmpfs": mounted,
        "server_env": threads,
        "settings": {**vars(args), "server_args": common, "mix": MIX, "prefill_piece": piece},
        "concurrency": {
            "clients": clients,
            "ramp": [lv._asdict() for lv in soak.ramp],
            "choice": soak.choice._asdict() if soak.choice else None,
        },
        "clients_started_t": round(soak.clients_t, 2),
        "clients_ended_t": round(soak.clients_end_t, 2),
        "server_logs": {s.name: s.log_paths for s in servers},
        "server_events": [e._asdict() for e in events],
        "windows": windows,
        "canary_checks": [c._asdict() for c in soak.canary],
        "tenant_probes": [p._asdict() for p in soak.probes],
        "final_server_metrics": final_metrics,
        "summary": summary,
        "series": [s._asdict() for s in soak.samples()],
        "series_caps": caps,
        "trends": trends(soak.samples(), soak.starts(), args.warmup_minutes * 60, caps),
        "sampler_errors": soak.sampler.errors[:50],
        "records": [r._asdict() for r in traffic.records],
    }
    out = write_json(args.out, result)
    png = plot(soak.samples(), windows, Path(args.out).with_suffix(".png"))
    print_summary(summary, windows, soak)
    failed = failures(summary)
    print(f"\nwrote {out} and {png}")
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
