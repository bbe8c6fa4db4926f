"""Scale-out: two to four servers behind SGLang's router, with and without the shared tier.

``python bench/scaleout.py --servers 2`` runs one Zipf RAG stream (a system chunk plus 2-6
MuSiQue passages drawn by Zipf popularity from a pool, and a fresh question; each chunk
marked with the delimiter, so the router sees plain text) against, per configuration:

- ``single``: one server, no router (the hit-rate reference for the same stream);
- for each mode (``local``: every server alone; ``shared``: all on one shared store started
  here, ``--pic-shared-store``) and router policy (``round_robin``, ``cache_aware``):
  ``--servers`` fresh servers behind ``python -m sglang_router.launch_router``.

Per configuration it reports aggregate throughput (requests/s and generated tokens/s over
the stream's wall time, ``--concurrency`` clients), TTFT (streamed, client side: median and
p90), the chunk hit rate (1 - misses / lookups, summed over the servers' /metrics), hits
per tier (device, host, disk, shared) and the shared tier's writes and outages.

In shared mode a tier probe follows the stream, one request at a time: a fresh prompt is
computed on server 0, then sent to server 1 (its chunks come from the shared tier: checked
in server 1's metrics) and, after /flush_cache, to server 0 again (host-memory hits:
checked too). Their TTFTs give the shared / host ratio, paired per prompt.

Results go to ``bench/results/scaleout.json``. Timings mean something only on a quiet
machine; ``--smoke`` runs a tiny stream to show the pipeline works.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_data_option,
    add_out_option,
    add_server_args_option,
    embedded_tokenizer,
    git_state,
    write_json,  # noqa: E402
)
from _server import Client, delta, launch, metric  # noqa: E402

DELIM = "<|pic_chunk|>"
TIERS = ("device", "host", "disk", "shared")


class Prompt(NamedTuple):
    text: str  # chunks enclosed in the delimiter, then the fresh question
    chunks: int


class Workload:
    """The stream: prompts over a Zipf-popular passage pool, drawn with one seed."""

    def __init__(self, data: Path, pool: int, passage_tokens: int, zipf: float) -> None:
        from sgl_pic.prompts import (
            PASSAGE_TEMPLATE,
            QUESTION_TEMPLATE,
            SYSTEM_TEXT,
            load_rag_examples,
            truncate_tokens,
        )

        tok = embedded_tokenizer()
        examples = load_rag_examples(data)
        texts = [p for ex in examples for p in ex.passages]
        random.Random(0).shuffle(texts)  # popularity independent of the file's order
        self.passages = [
            PASSAGE_TEMPLATE.format(text=truncate_tokens(tok, t, passage_tokens))
            for t in texts[: pool + 64]
        ]
        self.pool = pool  # passages past the pool are the tier probe's, never in the stream
        self.weights = [1.0 / (rank + 1) ** zipf for rank in range(pool)]
        self.questions = [QUESTION_TEMPLATE.format(question=ex.question) for ex in examples]
        self.system = SYSTEM_TEXT

    def compose(self, chosen: list[int], q: int, lead: bool = False) -> Prompt:
        """``lead``: a fresh line first, so no chunk shares a prefix with earlier prompts
        (a chunk that SGLang's prefix tree covers in part is always recomputed and never
        stored, which the tier probe must avoid)."""
        parts = [self.system, *(self.passages[i] for i in chosen)]
        # A fresh line before the question keeps SGLang's prefix tree from serving it.
        fresh = f"[{secrets.token_hex(4)}] "
        text = "".join(f"{DELIM}{p}{DELIM}" for p in parts) + fresh + self.questions[q]
        if lead:
            text = f"[{secrets.token_hex(4)}]\n" + text
        return Prompt(text, len(parts))

    def stream(self, n: int, seed: int) -> list[Prompt]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            k = rng.randint(2, 6)
            chosen: list[int] = []
            while len(chosen) < k:
                i = rng.choices(range(self.pool), weights=self.weights)[0]
                if i not in chosen:
                    chosen.append(i)
            out.append(self.compose(chosen, rng.randrange(len(self.questions))))
        return out

    def probe(self, i: int) -> Prompt:
        """Prompt ``i`` of the tier probe: two passages no stream prompt uses."""
        return self.compose([self.pool + 2 * i, self.pool + 2 * i + 1], i, lead=True)


def stream_request(url: str, prompt: Prompt, max_new_tokens: int) -> dict[str, float]:
    """One streamed /generate: TTFT, latency and generated tokens, client side."""
    body = {
        "text": prompt.text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            msg = json.loads(line[5:])
            tokens = int(msg.get("meta_info", {}).get("completion_tokens", tokens))
    latency = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else latency, "latency": latency, "tokens": tokens}


@contextmanager
def router(workers: list[str], policy: str) -> Iterator[str]:
    """SGLang's router over ``workers`` with ``policy``, stopped on exit."""
    from sgl_pic.cli.server_process import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in the finally below
        "wb", prefix="sgl_pic_router_", suffix=".log", delete=False
    )
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-port",  # its default (29000) may be taken by another router
        str(free_port()),
        # SGLang's /health runs a generation, queued behind the stream's prefills: on a
        # busy CPU it takes tens of seconds, and the router's default (5 s, 3 failures)
        # marks every worker unhealthy mid-run.
        "--health-check-timeout-secs",
        "120",
        "--health-failure-threshold",
        "5",
        "--worker-urls",
        *workers,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited ({proc.returncode}); log: {log.name}")
            # Its /health answers before the workers are registered (asynchronously), so
            # readiness is a plain request that a worker answered.
            ping = {"text": "ping", "sampling_params": {"max_new_tokens": 1}}
            try:
                if requests.post(url + "/generate", json=ping, timeout=30).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"router not ready in 120 s; log: {log.name}")
            time.sleep(0.5)
        print(f"  router ({policy}) at {url}, log {log.name}", flush=True)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def tier_totals(clients: list[Client]) -> dict[str, float]:
    """The sgl_pic series summed over the servers."""
    out: dict[str, float] = {}
    for c in clients:
        for k, v in c.metrics().items():
            out[k] = out.get(k, 0.0) + v
    return out


def summarize_metrics(d: dict[str, float]) -> dict[str, Any]:
    lookups = metric(d, "sgl_pic_chunk_lookups_total")
    # A miss store admission deferred (computed in context, not stored) is a miss too.
    misses = metric(d, "sgl_pic_chunk_misses_total") + metric(d, "sgl_pic_chunk_deferred_total")
    return {
        "chunk_lookups": lookups,
        "chunk_misses": misses,
        "hit_rate": None if not lookups else 1.0 - misses / lookups,
        "tier_hits": {t: metric(d, "sgl_pic_tier_hits_total", tier=t) for t in TIERS},
        "device_prefix_chunks": metric(d, "sgl_pic_chunk_device_prefix_total"),
        "shared_writes": {
            o: metric(d, "sgl_pic_shared_writes_total", outcome=o)
            for o in ("stored", "present", "failed", "skipped", "backfilled")
        },
        "shared_unreachable": metric(d, "sgl_pic_shared_store_unreachable_total"),
        "failures": metric(d, "sgl_pic_failures_total"),
    }


def run_stream(url: str, prompts: list[Prompt], concurrency: int, max_new: int) -> dict[str, Any]:
    records: list[dict[str, float]] = []
    lock = threading.Lock()

    def one_of(i: int) -> None:
        rec = stream_request(url, prompts[i], max_new)
        rec.update(request=i, chunks=prompts[i].chunks)
        with lock:
            records.append(rec)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one_of, range(len(prompts))))
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in records)
    return {
        "requests": len(records),
        "wall_s": wall,
        "requests_per_s": len(records) / wall,
        "tokens_per_s": sum(r["tokens"] for r in records) / wall,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "latency_median_s": statistics.median(r["latency"] for r in records),
        "records": sorted(records, key=lambda r: r["request"]),
    }


def tier_probe(clients: list[Client], w: Workload, n: int, max_new: int) -> dict[str, Any]:
    """Paired TTFTs of shared-tier hits (server 1) and host-memory hits (server 0) on
    prompts of two fresh passages each (the system chunk may hit in any tier). The same
    prompt text is sent three times: its fresh lead line is part of it."""
    a, b = clients[0], clients[1]
    rows = []
    for i in range(n):
        p = w.probe(i)
        stored0 = metric(a.metrics(), "sgl_pic_shared_writes_total", outcome="stored")
        stream_request(a.url, p, max_new)  # computed on server 0, written to the store
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the writes are asynchronous
            stored = metric(a.metrics(), "sgl_pic_shared_writes_total", outcome="stored")
            if stored >= stored0 + 2:
                break
            time.sleep(0.2)
        before_b = b.metrics()
        shared = stream_request(b.url, p, max_new)
        got_b = delta(before_b, b.metrics())
        a.flush()  # chunk nodes gone; host memory keeps the chunks
        before_a = a.metrics()
        host = stream_request(a.url, p, max_new)
        got_a = delta(before_a, a.metrics())
        rows.append(
            {
                "ttft_shared_s": shared["ttft"],
                "ttft_host_s": host["ttft"],
                "shared_hits": metric(got_b, "sgl_pic_tier_hits_total", tier="shared"),
                "host_hits": metric(got_a, "sgl_pic_tier_hits_total", tier="host"),
            }
        )
    ok = [r for r in rows if r["shared_hits"] >= 2 and r["host_hits"] >= 2]
    ratios = [r["ttft_shared_s"] / r["ttft_host_s"] for r in ok]
    return {
        "rows": rows,
        "checked": len(ok),
        "shared_over_host_ttft_median": statistics.median(ratios) if ratios else None,
    }


def launch_servers(stack: ExitStack, n: int, extra: list[str]) -> list[Client]:
    # The servers share this machine's cores: each gets its share of torch threads, or n
    # servers spinning 2 OpenMP threads each on 2 cores slow every prefill severalfold.
    threads = {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // n))}

    def one(_: int) -> Client:
        disk = tempfile.mkdtemp(prefix="sgl_pic_scaleout_disk_")
        return stack.enter_context(
            launch([*extra, "--pic-disk-cache-dir", disk], env_extra=threads)
        )

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def run_config(args: argparse.Namespace, w: Workload, mode: str, policy: str) -> dict[str, Any]:
    print(f"== {mode} / {policy}", flush=True)
    prompts = w.stream(args.requests, args.seed)
    extra = args.server_args.split()
    with ExitStack() as stack:
        if mode == "shared":
            from sgl_pic.store.shared.service import ServiceConfig, shared_store

            svc = stack.enter_context(
                shared_store(ServiceConfig(port=args.store_port, memory_mb=args.store_mb))
            )
            extra += ["--pic-shared-store", svc.url]
        n = 1 if mode == "single" else args.servers
        clients = launch_servers(stack, n, extra)
        before = tier_totals(clients)
        if mode == "single":
            result = run_stream(clients[0].url, prompts, args.concurrency, args.max_new_tokens)
        else:
            url = stack.enter_context(router([c.url for c in clients], policy))
            result = run_stream(url, prompts, args.concurrency, args.max_new_tokens)
        result["metrics"] = summarize_metrics(delta(before, tier_totals(clients)))
        if mode == "shared" and args.probe and n >= 2:
            result["tier_probe"] = tier_probe(clients, w, args.probe, args.max_new_tokens)
    result.update(mode=mode, policy=policy, servers=n)
    shown = {k: v for k, v in result.items() if k not in ("tier_probe", "records")}
    print(json.dumps(shown, indent=1), flush=True)
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures #13 is judged by, per mode: the hit rate's largest gap below the single
    server's (points), aggregate throughput, and the shared/host TTFT ratio of the probe."""
    out: dict[str, Any] = {}
    for mode in ("local", "shared"):
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        gaps = [r.get("hit_rate_points_below_single") for r in rows]
        out[mode] = {
            "hit_rate_points_below_single_max": None if None in gaps else max(gaps),
            "requests_per_s": {r["policy"]: r["requests_per_s"] for r in rows},
            "ttft_median_s": {r["policy"]: r["ttft_median_s"] for r in rows},
        }
        ratios = [
            r["tier_probe"]["shared_over_host_ttft_median"]
            for r in rows
            if r.get("tier_probe", {}).get("shared_over_host_ttft_median") is not None
        ]
        if mode == "shared":
            out[mode]["shared_over_host_ttft_median"] = ratios
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(ap)
    ap.add_argument("--servers", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--modes", default="local,shared", help="comma list of local, shared")
    ap.add_argument("--policies", default="round_robin,cache_aware")
    ap.add_argument("--no-single", action="store_true", help="skip the one-server reference")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool", type=int, default=64, help="passages in the Zipf pool")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--passage-tokens", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--probe", type=int, default=8, help="tier-probe prompts (shared mode)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--store-port", type=int, default=50551)
    ap.add_argument("--store-mb", type=int, default=4096)
    add_server_args_option(ap, help="extra flags for every server")
    ap.add_argument("--smoke", action="store_true", help="a tiny stream: the pipeline works")
    add_out_option(ap, "scaleout.json")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.pool, args.probe = 6, 2, 8, 1
        args.passage_tokens, args.max_new_tokens = 64, 4
    commit, dirty = git_state()
    w = Workload(Path(args.data), args.pool, args.passage_tokens, args.zipf)
    configs = [] if args.no_single else [("single", "-")]
    configs += [(m, p) for m in args.modes.split(",") for p in args.policies.split(",")]
    results = [run_config(args, w, m, p) for m, p in configs]
    report = {"git_commit": commit, "git_dirty": dirty, "args": vars(args), "results": results}
    single = next((r for r in results if r["mode"] == "single"), None)
    if single is not None and single["metrics"]["hit_rate"] is not None:
        for r in results:
            if r["mode"] != "single" and r["metrics"]["hit_rate"] is not None:
                r["hit_rate_points_below_single"] = 100 * (
                    single["metrics"]["hit_rate"] - r["metrics"]["hit_rate"]
                )
    report["summary"] = summary(results)
    print(json.dumps(report["summary"], indent=1))
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
