"""Four workloads against SGLang's own prefix caching (``bench/workload_streams.py``).

``python bench/workloads.py`` runs, per workload, the same stream of sessions (``--requests``
requests, ``--concurrency`` sessions at a time, each session's requests in order) against:

- ``prefix_caching``: ``--pic-disable`` (plain SGLang, its radix prefix cache), the requests
  without chunk marks;
- ``prefix_caching_first_token``: the same, one output token per request (the earlier
  ideal's decode estimate, below);
- ``sgl_pic``: chunk marks (/generate) or auto-chunking (chat), default policy; on
  ``rag_churn`` also ``sgl_pic_lru`` (``--pic-eviction lru``), to show what the eviction
  policy keeps.

``--configs`` picks the configurations run side by side (``prefix_caching`` and ``sgl_pic``
always among them); besides those above it takes the variants of ``VARIANTS``, sgl-pic
with one setting changed (``sgl_pic_daric``: ``--pic-policy daric``, a selection without
the query probe; ``sgl_pic_ref``: the default's flags, its server run from another
checkout, ``--ref-root``, so two commits' code meet the same stream in one run). Each
variant gets the default's figures against the same prefix-caching run
(``reuse_figures``, in ``compare``'s ``variants``: its fraction of its own ideal, extend
seconds over that ideal's, greedy agreement), so a setting's throughput is read beside
what it does to the answers. Without ``prefix_caching_first_token`` the replay ideal is
not reported.

Both get the same bounded cache (``--server-args``, by default a quarter of SGLang's KV pool
for chunk nodes and 256 MiB of host memory, no disk tier), so that the churn of novel
chunks does evict.

Per run: throughput (requests/s over the stream's wall time), TTFT p50/p99 (streamed,
client side), the token hit rate (prompt tokens served from cache: SGLang's cached prefix,
plus chunk-hit tokens for sgl-pic), the chunk hit rate over time (windows of
``--window`` completions, from /metrics), the recomputed fraction, evictions per tier, and
greedy agreement with exact prefill: a seeded sample of the stream's requests sent again
with ``policy: full_recompute``, its answer compared with the one the stream got.

The ideal, from prefill work: the prompt tokens prefix caching did not have cached, over
sgl-pic's (prompt tokens past the device prefix, less the chunk tokens it reused; its
recomputed tokens count as work). ``ideal_prefill_speedup`` is that ratio: the throughput
ratio if a request's time were its prefill tokens alone. Reuse shortens extend forwards and
nothing else: every request decodes the same tokens in both runs, and is received,
tokenized, scheduled and answered the same way. Every server counts the seconds of its
model runner's forwards by kind (``sgl_pic_forward_seconds_total``, ``forward_timer``; on
``--pic-disable`` too), so ``ideal_speedup`` is prefix caching's wall time with its extend
forwards' seconds scaled by the work ratio and everything else kept; ``fraction_of_ideal``
is the measured throughput ratio over it, and ``fraction_of_prefill_ideal`` the same over
the prefill-only ratio. Selection, assembly, phase 1 of missed chunks, the probe and every
other sgl-pic overhead count against it: those inside a forward lengthen sgl-pic's extend
seconds, the rest (chunk lookups when a batch is formed, chat auto-chunking) its wall time.
``forward_seconds`` and ``extend_over_ideal`` (sgl-pic's extend seconds over prefix
caching's scaled by the work ratio) say which. ``forward_counts`` (forwards by kind and the
requests in them) gives ``decode_step_s_over_base`` and ``decode_requests_per_step``: the
same tokens decoded in more steps of fewer requests cost more seconds without any step
being slower.

Until e34fb2a the ideal came from a second prefix-caching server that replays the stream
with one output token per request (``prefix_caching_first_token``): its wall time stood for
prefill, and prefix caching's wall less it for decode; that ideal scaled the whole
first-token wall time, request handling included, by the work ratio (a bound above what
reuse can reach), and a difference of two wall times moves from block to block. It is still
run and reported as ``ideal_speedup_replay`` and ``fraction_of_ideal_replay``, with
``fraction_of_ideal_in_run_decode``, which takes decode inside the prefix-caching run
(``decode_share_in_run``: the share of its requests' time after their first token).
``computed_over_ideal_work`` and ``tokens_per_forward`` say
where the gap comes from: the tokens sgl-pic computed (phase 1 and phase 2; a missed
chunk's tokens that phase 2 recomputes in context run twice) over the work the ideal
counts, and the mean tokens of SGLang's extend batches (prefix caching) against those of
the phase forwards (phase 1, probe, phase 2) sgl-pic splits its batches into: on a CPU a
forward of fewer tokens costs more per token (``bench/layer_batch.py``).

One run after another gives a slow spell of this shared 2-core machine to whichever ran
then (at f7bcfd9, rag_churn's sgl-pic with GDSF and then with LRU eviction did about the
same prefill work, 55.5k and 56.5k tokens, in 221 s and 199 s). ``--interleave N``
runs the three configurations behind the ideal side by side instead (``run_interleaved``):
all three servers up (those not serving paused), the stream sent to each in turn in blocks
of at least N requests. Each block also gets its own ideal, from that block of prefix
caching, and ``fraction_of_ideal_blocks`` lists sgl-pic's fraction of it block by block
(with their median): the spread of one run's blocks says how far a single figure can be
trusted.

Before its stream every server runs ``--server-warmup`` plain requests at once, of the
streams' size (``server_warmup``), and has its prefix tree flushed (``warm_up``): nothing
of them stays in any cache. A fresh server's first large forwards pay a one-time cost,
most of it in the dense layers' first matmuls of that size, which the stream's first
requests carried before: at 4e1077a fewshot's first four requests had a TTFT of 17.5 s on
sgl-pic, 12.3 s on prefix caching and 7.0 s on its one-token replay.

Results: ``bench/results/workloads.json`` (commit, dirty flag, per-request records) and
``workloads.png`` (hit rate over time). Timings mean something only on a quiet machine;
``--smoke`` shows the pipeline works.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, add_data_option, add_out_option, git_state, write_json  # noqa: E402
from _server import Client, delta, launch, metric  # noqa: E402
from workload_streams import (  # noqa: E402
    TEMPLATED_WORKLOADS,
    WORKLOADS,
    Request,
    Session,
    Streams,
    server_warmup,
    tool_template_model,
)

from sgl_pic.binding.forward_timer import (  # noqa: E402
    FORWARDS_METRIC,
    MODES,
    REQUESTS_METRIC,
)

FORWARD_METRIC = "sgl_pic_forward_seconds_total"

SERVER_ARGS = (
    "--pic-device-cache-fraction 0.25 --pic-host-cache-mb 256 --pic-disk-cache-dir '' "
    "--enable-cache-report --enable-metrics"
)
AUTO = "tool,document,user,assistant"
# sgl-pic with one setting changed, named by what changed: the flags added to sgl_pic's.
VARIANTS = {
    "sgl_pic_lru": ["--pic-eviction", "lru"],
    "sgl_pic_daric": ["--pic-policy", "daric"],
    # The default's flags, its server run from the checkout at --ref-root (another commit).
    "sgl_pic_ref": [],
}
DEFAULT_CONFIGS = ("prefix_caching", "prefix_caching_first_token", "sgl_pic")
PASSAGE_TOKENS = 120  # passages are cut to this many tokens
MAX_NEW_TOKENS = 8


def send(url: str, req: Request, form: str, extra_pic: dict[str, Any] | None = None) -> dict:
    """One streamed request; TTFT, latency, prompt/cached/completion tokens and the text."""
    body = dict(req.pic if form == "pic" else req.base)
    if extra_pic:
        body["pic"] = {**body.get("pic", {}), **extra_pic}
    body["stream"] = True
    if req.endpoint == "chat":
        body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions"
    else:
        path = "/generate"
    t0 = time.perf_counter()
    ttft = None
    text = ""
    usage: dict[str, Any] = {}
    with requests.post(url + path, json=body, stream=True, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if req.endpoint == "chat":
                for choice in msg.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
                if msg.get("usage"):
                    u = msg["usage"]
                    usage = {
                        "prompt": u.get("prompt_tokens", 0),
                        "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                        "completion": u.get("completion_tokens", 0),
                    }
            else:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text = msg.get("text", text)
                m = msg.get("meta_info", {})
                usage = {
                    "prompt": m.get("prompt_tokens", 0),
                    "cached": m.get("cached_tokens", 0),
                    "completion": m.get("completion_tokens", 0),
                }
    latency = time.perf_counter() - t0
    return {"ttft": latency if ttft is None else ttft, "latency": latency, "text": text, **usage}


def run_stream(
    client: Client, sessions: list[Session], form: str, concurrency: int, window: int
) -> dict[str, Any]:
    """The sessions, ``concurrency`` at a time; /metrics scraped every ``window``
    completions (the chunk hit rate over time)."""
    todo: queue.Queue[tuple[int, Session]] = queue.Queue()
    for i, s in enumerate(sessions):
        todo.put((i, s))
    done: queue.Queue[dict[str, Any]] = queue.Queue()
    order = 0
    order_lock = threading.Lock()

    def worker() -> None:
        nonlocal order
        while True:
            try:
                i, session = todo.get_nowait()
            except queue.Empty:
                return
            for t, req in enumerate(session):
                rec = send(client.url, req, form)
                with order_lock:
                    rec.update(session=i, turn=t, completed=order)
                    order += 1
                done.put(rec)

    total = sum(len(s) for s in sessions)
    records: list[dict[str, Any]] = []
    windows = []
    first = last = client.metrics()
    upto = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(worker) for _ in range(concurrency)]
        while len(records) < total:
            try:
                records.append(done.get(timeout=1.0))
            except queue.Empty:
                for f in futures:
                    if f.done():
                        f.result()  # a worker's error ends the run
                continue
            if len(records) % window == 0 or len(records) == total:
                now = client.metrics()
                # The requests since the last window: a stream's last window may be short.
                windows.append(_window(delta(last, now), records[upto:], len(records)))
                last, upto = now, len(records)
        for f in futures:
            f.result()
    res = stream_figures(records, time.perf_counter() - t0, windows)
    # ``last`` was scraped at the last completion: the whole stream's delta.
    res["blocks"] = [block_figures(delta(first, last), records, res["wall_s"])]
    return res


def prefill_work(d: dict[str, float], recs: list[dict[str, Any]]) -> float:
    """Prompt tokens computed over ``recs``: neither in SGLang's cached prefix nor reused
    chunk tokens (the /metrics delta ``d`` over them; none on ``--pic-disable``)."""
    return sum(r["prompt"] - r["cached"] for r in recs) - metric(d, "sgl_pic_reused_tokens_total")


def block_figures(d: dict[str, float], recs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """What one stream (or one block of an interleaved run) needs for its own ideal:
    its wall time, its forward seconds and its prefill work, from the /metrics delta
    over it."""
    work = prefill_work(d, recs)
    return {"wall_s": wall, "forward_seconds": forward_seconds(d), "prefill_work_tokens": work}


def stream_figures(
    records: list[dict[str, Any]], wall: float, windows: list[dict[str, Any]]
) -> dict[str, Any]:
    """A stream's figures from its per-request records and wall time (a run's, or the
    sum of an interleaved run's blocks)."""
    ttfts = sorted(r["ttft"] for r in records)
    return {
        "requests": len(records),
        "wall_s": wall,
        "requests_per_s": len(records) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "prompt_tokens": sum(r["prompt"] for r in records),
        "prefix_cached_tokens": sum(r["cached"] for r in records),
        "windows": windows,
        "records": sorted(records, key=lambda r: (r["session"], r["turn"])),
    }


def _window(d: dict[str, float], recs: list[dict[str, Any]], upto: int) -> dict[str, Any]:
    """One window of completions: the chunk hit rate (1 - misses / lookups, /metrics; a
    miss store admission deferred is a miss) and the token reuse rate (prompt tokens not
    computed: SGLang's cached prefix, plus chunk tokens reused without recomputation)."""
    lookups = metric(d, "sgl_pic_chunk_lookups_total")
    misses = metric(d, "sgl_pic_chunk_misses_total") + metric(d, "sgl_pic_chunk_deferred_total")
    prompt = sum(r["prompt"] for r in recs)
    not_computed = sum(r["cached"] for r in recs) + metric(d, "sgl_pic_reused_tokens_total")
    return {
        "completed": upto,
        "chunk_hit_rate": None if not lookups else 1.0 - misses / lookups,
        "token_reuse_rate": not_computed / max(prompt, 1),
    }


def agreement(
    client: Client, sessions: list[Session], stream: dict[str, Any], n: int, seed: int
) -> dict[str, Any]:
    """A seeded sample of the stream's requests sent again as exact prefill
    (``policy: full_recompute``): how many answers equal the stream's (greedy)."""
    flat = [(i, t, req) for i, s in enumerate(sessions) for t, req in enumerate(s)]
    by_key = {(r["session"], r["turn"]): r for r in stream["records"]}
    sample = random.Random(seed).sample(flat, min(n, len(flat)))
    rows = []
    for i, t, req in sample:
        exact = send(client.url, req, "pic", {"config": {"policy": "full_recompute"}})
        got = by_key[(i, t)]["text"]
        rows.append(
            {
                "session": i,
                "turn": t,
                "equal": exact["text"] == got,
                "reuse": got,
                "exact": exact["text"],
            }
        )
    return {
        "sampled": len(rows),
        "greedy_agreement": sum(r["equal"] for r in rows) / len(rows),
        "rows": rows,
    }


def pic_figures(d: dict[str, float]) -> dict[str, Any]:
    lookups = metric(d, "sgl_pic_chunk_lookups_total")
    new = metric(d, "sgl_pic_new_tokens_total")
    encoded = metric(d, "sgl_pic_encoded_tokens_total")
    recomputed = metric(d, "sgl_pic_recomputed_tokens_total")
    reused = metric(d, "sgl_pic_reused_tokens_total")
    misses = metric(d, "sgl_pic_chunk_misses_total")
    deferred = metric(d, "sgl_pic_chunk_deferred_total")
    forwards = {
        p: {
            "forwards": metric(d, "sgl_pic_phase_forwards_total", phase=p),
            "tokens": metric(d, "sgl_pic_phase_forward_tokens_total", phase=p),
        }
        for p in ("phase1", "probe", "deviation", "phase2")
    }
    for f in forwards.values():
        f["tokens_per_forward"] = f["tokens"] / max(f["forwards"], 1)
    return {
        # Phase 1 plus phase 2: a new token past the device prefix is reused, recomputed,
        # or a missed chunk's phase-1 KV kept as it is; the rest of the missed chunks'
        # tokens ran twice (phase 1, then again in context), which the ideal does not count.
        "computed_tokens": encoded + recomputed,
        "encoded_tokens": encoded,
        "recomputed_tokens": recomputed,
        "missed_tokens_computed_twice": encoded + recomputed + reused - new,
        "phase_forwards": forwards,
        "chunk_lookups": lookups,
        "chunk_hit_rate": None if not lookups else 1 - (misses + deferred) / lookups,
        # Misses computed in context only, not stored (--pic-admission).
        "deferred_chunks": deferred,
        "device_prefix_chunks": metric(d, "sgl_pic_chunk_device_prefix_total"),
        "reused_tokens": metric(d, "sgl_pic_reused_tokens_total"),
        "recomputed_fraction": None
        if not new
        else metric(d, "sgl_pic_recomputed_tokens_total") / new,
        "tier_hits": {
            t: metric(d, "sgl_pic_tier_hits_total", tier=t) for t in ("device", "host", "disk")
        },
        "evictions": {
            t: metric(d, "sgl_pic_evictions_total", tier=t) for t in ("device", "host", "disk")
        },
        "failures": metric(d, "sgl_pic_failures_total") + metric(d, "sgl_pic_fallbacks_total"),
        "fallbacks": metric(d, "sgl_pic_fallbacks_total"),
        # Requests SGLang cut into prefill pieces (planned whole at the first), and pieces.
        "split_requests": metric(d, "sgl_pic_split_requests_total"),
        "prefill_pieces": metric(d, "sgl_pic_prefill_pieces_total"),
    }


def forward_seconds(d: dict[str, float]) -> dict[str, float]:
    """Seconds of the run's forwards by kind, from a /metrics delta; a server that does not
    export them fails the run (the ideal cannot be built without them)."""
    if not any(k.startswith(FORWARD_METRIC + "{") for k in d):
        raise RuntimeError(f"the server exports no {FORWARD_METRIC} (needs --enable-metrics)")
    return {m: metric(d, FORWARD_METRIC, mode=m) for m in MODES}


def forward_counts(d: dict[str, float]) -> dict[str, dict[str, float]]:
    """Forwards by kind and the requests in them, from a /metrics delta: how the same
    stream's decode was batched on each server (``forward_timer``)."""
    return {
        "forwards": {m: metric(d, FORWARDS_METRIC + "_total", mode=m) for m in MODES},
        "requests": {m: metric(d, REQUESTS_METRIC + "_total", mode=m) for m in MODES},
    }


def first_token_only(sessions: list[Session]) -> list[Session]:
    """The sessions with one output token per request (both forms)."""

    def one(body: dict[str, Any]) -> dict[str, Any]:
        body = dict(body)
        if "sampling_params" in body:
            body["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 1}
        else:
            body["max_tokens"] = 1
        return body

    return [[r._replace(pic=one(r.pic), base=one(r.base)) for r in s] for s in sessions]


def warm_up(client: Client, reqs: list[Request]) -> float:
    """Sends ``reqs`` (``server_warmup``) at once, plain, then flushes SGLang's prefix tree:
    the server has run forwards of the streams' size and holds none of their text. Wall
    seconds."""
    t0 = time.perf_counter()
    if reqs:
        with ThreadPoolExecutor(len(reqs)) as pool:
            list(pool.map(lambda r: send(client.url, r, "base"), reqs))
        client.flush()
    return time.perf_counter() - t0


def config_flags(server_args: str, config: str) -> list[str]:
    """The server flags of one configuration, on top of ``server_args``."""
    flags = shlex.split(server_args)
    if "--enable-metrics" not in flags:
        flags.append("--enable-metrics")  # the forward seconds the ideal is built from
    if config.startswith("prefix_caching"):
        return [*flags, "--pic-disable"]
    flags += ["--pic-auto-chunk", AUTO]
    return flags + VARIANTS.get(config, [])


def config_root(args: argparse.Namespace, config: str) -> Path:
    """The checkout whose code a configuration's server runs: ``--ref-root`` for
    ``sgl_pic_ref``, this one for the others."""
    return Path(args.ref_root) if config == "sgl_pic_ref" else ROOT


def model_flags(workload: str) -> list[str]:
    """The model a workload's servers run: for the chat workloads with tools, the embedded
    model with a tool-aware chat template (``tool_template_model``), else the default."""
    if workload in TEMPLATED_WORKLOADS:
        return ["--model-path", str(tool_template_model())]
    return []


def config_form(config: str) -> str:
    """Which body of each request a configuration sends: "base" (unmarked) or "pic"."""
    return "base" if config.startswith("prefix_caching") else "pic"


def run_one(
    args: argparse.Namespace,
    name: str,
    sessions: list[Session],
    config: str,
    warmup: list[Request],
) -> dict:
    flags = config_flags(args.server_args, config) + model_flags(name)
    print(f"== {name} / {config}", flush=True)
    with launch(flags, root=config_root(args, config)) as client:
        warm_s = warm_up(client, warmup)
        before = client.metrics()
        client.skip_log()
        res = run_stream(
            client, stream_of(sessions, config), config_form(config), args.concurrency, args.window
        )
        res["server_warmup_s"] = warm_s
        return finish(args, client, before, sessions, res, config)


def run_interleaved(
    args: argparse.Namespace,
    name: str,
    sessions: list[Session],
    configs: list[str],
    warmup: list[Request],
) -> dict[str, dict]:
    """``--interleave N``: every configuration's server up at once, paused (SIGSTOP) while
    another runs, and the stream sent in blocks of whole sessions of at least
    N requests, each block to every server in turn, the order reversed every other block.
    A slow spell of this machine then falls on every configuration alike, where one run
    after another gives it to whichever ran then. A configuration's figures are over all of
    its blocks: wall times summed, records and hit-rate windows joined; its server keeps
    its cache from block to block, as in one stream."""
    blocks: list[list[Session]] = [[]]
    for session in sessions:
        if blocks[-1] and sum(len(s) for s in blocks[-1]) >= args.interleave:
            blocks.append([])
        blocks[-1].append(session)
    with ExitStack() as stack:
        clients: dict[str, Client] = {}
        for c in configs:
            print(f"== {name} / {c} (interleaved, {len(blocks)} blocks)", flush=True)
            flags = config_flags(args.server_args, c) + model_flags(name)
            clients[c] = stack.enter_context(launch(flags, root=config_root(args, c)))
            clients[c].pause()
            # Resumed before the server is killed: a stopped process does not act on SIGTERM.
            stack.callback(clients[c].resume)
        before: dict[str, dict[str, float]] = {}
        warm_s: dict[str, float] = {}
        for c, cl in clients.items():
            with running(cl):
                warm_s[c] = warm_up(cl, warmup)
                before[c] = cl.metrics()
            cl.skip_log()
        parts: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for k, block in enumerate(blocks):
            for c in configs if k % 2 == 0 else configs[::-1]:
                with running(clients[c]):
                    part = run_stream(
                        clients[c],
                        stream_of(block, c),
                        config_form(c),
                        args.concurrency,
                        args.window,
                    )
                print(f"  block {k}: {c} {part['wall_s']:.1f} s", flush=True)
                parts[c].append(part)
        out = {}
        for c in configs:
            with running(clients[c]):
                res = joined(parts[c], blocks)
                res["server_warmup_s"] = warm_s[c]
                out[c] = finish(args, clients[c], before[c], sessions, res, c)
        return out


@contextmanager
def running(client: Client) -> Iterator[None]:
    """The one server of an interleaved run that is not paused, for the ``with`` body."""
    client.resume()
    try:
        yield
    finally:
        client.pause()


def joined(parts: list[dict[str, Any]], blocks: list[list[Session]]) -> dict[str, Any]:
    """One stream's figures from its blocks' (``run_stream``): session numbers and
    completion counts moved past the blocks before."""
    records: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    first_session = 0
    for part, block in zip(parts, blocks, strict=True):
        done = len(records)
        records += [
            {**r, "session": r["session"] + first_session, "completed": r["completed"] + done}
            for r in part["records"]
        ]
        windows += [{**w, "completed": w["completed"] + done} for w in part["windows"]]
        first_session += len(block)
    res = stream_figures(records, sum(p["wall_s"] for p in parts), windows)
    blocks = [b for p in parts for b in p["blocks"]]
    return {**res, "block_wall_s": [p["wall_s"] for p in parts], "blocks": blocks}


def stream_of(sessions: list[Session], config: str) -> list[Session]:
    return first_token_only(sessions) if config == "prefix_caching_first_token" else sessions


def finish(
    args: argparse.Namespace,
    client: Client,
    before: dict[str, float],
    sessions: list[Session],
    res: dict[str, Any],
    config: str,
) -> dict[str, Any]:
    """A run's figures from its stream (``res``) and the server's metrics and log since
    ``before``; the greedy-agreement sample for sgl-pic."""
    form = config_form(config)
    batches, batch_tokens = client.prefill_batches()
    res["prefill_batches"] = batches
    res["tokens_per_prefill_batch"] = batch_tokens / max(batches, 1)
    d = delta(before, client.metrics())
    res["forward_seconds"] = forward_seconds(d)
    res["forward_counts"] = forward_counts(d)
    res["pic"] = pic_figures(d) if form == "pic" else None
    if form == "pic" and args.agreement:
        res["agreement"] = agreement(client, sessions, res, args.agreement, args.seed)
    res["prefill_work_tokens"] = prefill_work(d, res["records"])
    res["token_reuse_rate"] = 1 - res["prefill_work_tokens"] / max(res["prompt_tokens"], 1)
    res["config"] = config
    shown = {k: v for k, v in res.items() if k not in ("records", "windows", "agreement")}
    print(json.dumps(shown, indent=1), flush=True)
    return res


def extend_seconds(run: dict[str, Any]) -> float:
    """Seconds of a run's (or block's) forwards that prefill: extend and mixed."""
    return run["forward_seconds"]["extend"] + run["forward_seconds"]["mixed"]


def per_decode_step(run: dict[str, Any], total: float) -> float:
    """``total`` (a run's decode seconds, or its decode request-steps) per decode forward."""
    return total / max(run["forward_counts"]["forwards"]["decode"], 1)


def ideal_wall_s(base: dict[str, Any], pic: dict[str, Any]) -> float:
    """Prefix caching's wall time (a run's or a block's) with its extend forwards'
    seconds scaled by the work ratio, sgl-pic's prefill work over its own."""
    work = pic["prefill_work_tokens"] / max(base["prefill_work_tokens"], 1)
    return base["wall_s"] - extend_seconds(base) * (1 - work)


def compare(runs: dict[str, dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The figures of one workload: throughput and TTFT ratios, the ideal speedups and the
    fractions of them reached (module docstring); for the churn check, the chunk hit rate
    of the first and last quarter of the windows after ``warmup`` completions."""
    base, pic = runs["prefix_caching"], runs["sgl_pic"]
    one_token = runs.get("prefix_caching_first_token")
    work = pic["prefill_work_tokens"] / max(base["prefill_work_tokens"], 1)
    base_extend = extend_seconds(base)
    reuse = reuse_figures(base, pic)
    # The earlier ideal: decode as prefix caching's wall less its one-token replay's.
    decode_s = max(base["wall_s"] - one_token["wall_s"], 0.0) if one_token else None
    replay_wall = decode_s + one_token["wall_s"] * work if one_token else None
    # The same with decode taken inside the prefix-caching run alone: the share of its
    # requests' time after their first token (no second run's wall time in it).
    after_first = sum(r["latency"] - r["ttft"] for r in base["records"])
    decode_share = after_first / max(sum(r["latency"] for r in base["records"]), 1e-9)
    proxy_wall = base["wall_s"] * (decode_share + (1 - decode_share) * work)
    pic_ttft = {(r["session"], r["turn"]): r["ttft"] for r in pic["records"]}
    out: dict[str, Any] = {
        **reuse,
        "ttft_p50_ratio": base["ttft_p50_s"] / pic["ttft_p50_s"],
        # Per request: the same request's TTFT in both runs (each run concurrent, so a
        # request's neighbours differ between them).
        "ttft_paired_median_ratio": statistics.median(
            r["ttft"] / pic_ttft[(r["session"], r["turn"])] for r in base["records"]
        ),
        "extend_share_of_base": base_extend / base["wall_s"],
        "ideal_prefill_speedup": 1 / max(work, 1e-9),
        "fraction_of_prefill_ideal": reuse["throughput_ratio"] * work,
        "fraction_of_ideal_block_median": statistics.median(reuse["fraction_of_ideal_blocks"]),
        # Decode over steps, and the requests a step held: a server whose prefill
        # ends sooner may decode the same tokens in more steps of fewer requests.
        "decode_step_s_over_base": per_decode_step(pic, pic["forward_seconds"]["decode"])
        / max(per_decode_step(base, base["forward_seconds"]["decode"]), 1e-9),
        "decode_requests_per_step": {
            c: per_decode_step(runs[c], runs[c]["forward_counts"]["requests"]["decode"])
            for c in ("prefix_caching", "sgl_pic")
        },
        "outside_forwards_s": {
            c: runs[c]["wall_s"] - sum(runs[c]["forward_seconds"].values())
            for c in ("prefix_caching", "sgl_pic")
        },
        "decode_share_of_base": decode_s / base["wall_s"] if one_token else None,
        "ideal_speedup_replay": base["wall_s"] / replay_wall if replay_wall else None,
        "fraction_of_ideal_replay": replay_wall / pic["wall_s"] if replay_wall else None,
        "decode_share_in_run": decode_share,
        "fraction_of_ideal_in_run_decode": proxy_wall / pic["wall_s"],
        # Where the gap to the ideal comes from in forward sizes: the tokens per forward of
        # SGLang's extend batches against those of the phase forwards sgl-pic splits them
        # into.
        "tokens_per_forward": {
            "prefix_caching": base["tokens_per_prefill_batch"],
            **{
                f"sgl_pic_{p}": f["tokens_per_forward"]
                for p, f in pic["pic"]["phase_forwards"].items()
                if f["forwards"]
            },
        },
        "token_reuse_rate": {c: r["token_reuse_rate"] for c, r in runs.items()},
        "variants": {c: reuse_figures(base, r) for c, r in runs.items() if c in VARIANTS},
    }
    for c, r in runs.items():
        if r["pic"] is None:
            continue
        w = [x for x in r["windows"] if x["completed"] > warmup and x["chunk_hit_rate"] is not None]
        q = max(len(w) // 4, 1)
        first = statistics.mean(x["chunk_hit_rate"] for x in w[:q]) if w else None
        last = statistics.mean(x["chunk_hit_rate"] for x in w[-q:]) if w else None
        out[f"{c}_hit_rate_quarters"] = {
            "first": first,
            "last": last,
            "last_over_first": None if not first else last / first,  # type: ignore[operator]
        }
    return out


def reuse_figures(base: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """One sgl-pic configuration (the default or a variant) against prefix caching: its
    throughput, its fraction of the ideal its own prefill work implies, and what its
    selection did to the answers.

    Block by block (where both ran in the same blocks, as in an interleaved run): each
    block's ideal from that block of prefix caching, against the same block of sgl-pic run
    next to it. Their spread is how far one block's figure moves on this machine; the
    whole run's is their pooled value. Extend seconds are over the ideal's (prefix
    caching's, scaled by the work), decode seconds over prefix caching's; the tokens
    computed (phase 1 and phase 2) over the work the ideal counts say where the gap comes
    from in tokens."""
    work = run["prefill_work_tokens"] / max(base["prefill_work_tokens"], 1)
    blocks = None
    if len(run["blocks"]) == len(base["blocks"]):
        pairs = zip(base["blocks"], run["blocks"], strict=True)
        blocks = [ideal_wall_s(b, r) / r["wall_s"] for b, r in pairs]
    return {
        "throughput_ratio": base["wall_s"] / run["wall_s"],
        "ideal_speedup": base["wall_s"] / ideal_wall_s(base, run),
        "fraction_of_ideal": ideal_wall_s(base, run) / run["wall_s"],
        "fraction_of_ideal_blocks": blocks,
        "extend_over_ideal": extend_seconds(run) / max(extend_seconds(base) * work, 1e-9),
        "decode_over_base": run["forward_seconds"]["decode"]
        / max(base["forward_seconds"]["decode"], 1e-9),
        "recomputed_fraction": run["pic"]["recomputed_fraction"],
        "computed_over_ideal_work": run["pic"]["computed_tokens"]
        / max(run["prefill_work_tokens"], 1),
        "probe_forwards": run["pic"]["phase_forwards"]["probe"]["forwards"],
        "greedy_agreement": run.get("agreement", {}).get("greedy_agreement"),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        runs = report["workloads"][name]["runs"]
        for c, r in runs.items():
            if c == "prefix_caching_first_token":
                continue  # the same stream as prefix_caching, timed for the ideal alone
            xs = [w["completed"] for w in r["windows"]]
            ax.plot(xs, [w["token_reuse_rate"] for w in r["windows"]], label=f"{c}: tokens reused")
            if r["pic"] is not None:
                ys = [w["chunk_hit_rate"] for w in r["windows"]]
                ax.plot(xs, ys, "--", label=f"{c}: chunk hit rate")
        cmp_ = report["workloads"][name]["compare"]
        ax.set_title(
            f"{name}: {cmp_['throughput_ratio']:.2f}x, {cmp_['fraction_of_ideal']:.2f} of ideal",
            fontsize=9,
        )
        ax.set_xlabel("requests completed")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("rate per window")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(ap)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=PASSAGE_TOKENS)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--window", type=int, default=10, help="completions per hit-rate window")
    ap.add_argument("--warmup", type=int, default=30, help="completions before the churn check")
    ap.add_argument("--agreement", type=int, default=16, help="requests re-sent exactly")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="requests per block: all servers up at once, the stream sent block by block "
        "to each in turn (0: one run after another)",
    )
    ap.add_argument("--server-args", default=SERVER_ARGS, help="flags of every server")
    ap.add_argument(
        "--server-warmup",
        type=int,
        default=4,
        help="plain requests every server runs (at once) before its stream, 0: none",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny stream: the pipeline works")
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="configurations run side by side: prefix_caching and sgl_pic, and any of "
        f"prefix_caching_first_token, {', '.join(VARIANTS)}",
    )
    ap.add_argument(
        "--ref-root",
        default=None,
        help="the checkout (e.g. a worktree at another commit) whose code sgl_pic_ref runs",
    )
    add_out_option(ap, "workloads.json")
    args = ap.parse_args()
    configs = args.configs.split(",")
    known = {*DEFAULT_CONFIGS, *VARIANTS}
    if not {"prefix_caching", "sgl_pic"} <= set(configs) or not set(configs) <= known:
        ap.error(f"--configs needs prefix_caching and sgl_pic, from {sorted(known)}: {configs}")
    if len(set(configs)) != len(configs):
        ap.error(f"--configs names a configuration twice: {configs}")
    if ("sgl_pic_ref" in configs) != (args.ref_root is not None):
        ap.error("--ref-root and the sgl_pic_ref configuration go together")
    if args.ref_root is not None and not (Path(args.ref_root) / "sgl_pic").is_dir():
        ap.error(f"--ref-root has no sgl_pic package: {args.ref_root}")
    if args.interleave < 0:
        ap.error(f"--interleave must be >= 0, got {args.interleave}")
    if args.server_warmup < 0:
        ap.error(f"--server-warmup must be >= 0, got {args.server_warmup}")
    if args.smoke:
        args.requests, args.window, args.warmup, args.agreement = 8, 2, 0, 2
        args.passage_tokens, args.max_new_tokens = 48, 4
    commit, dirty = git_state()
    src = Streams(Path(args.data), args.passage_tokens, args.max_new_tokens)
    report: dict[str, Any] = {
        "git_commit": commit,
        "git_dirty": dirty,
        "args": vars(args),
        "workloads": {},
    }
    if args.ref_root is not None:
        report["ref_git"] = git_state(root=Path(args.ref_root))._asdict()
    warmup = server_warmup(src, args.server_warmup)
    for name in args.workloads.split(","):
        sessions = WORKLOADS[name](src, args.requests, args.seed)
        if args.interleave:
            runs = run_interleaved(args, name, sessions, configs, warmup)
        else:
            runs = {c: run_one(args, name, sessions, c, warmup) for c in configs}
        if name == "rag_churn" and "sgl_pic_lru" not in configs:
            # Alone in both modes: a fourth server at once would not fit in 24 GiB.
            runs["sgl_pic_lru"] = run_one(args, name, sessions, "sgl_pic_lru", warmup)
        report["workloads"][name] = {"runs": runs, "compare": compare(runs, args.warmup)}
        print(json.dumps({name: report["workloads"][name]["compare"]}, indent=1), flush=True)
    out = write_json(args.out, report)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
