"""Soak test: concurrent mixed traffic for minutes, one kill -9 of the server at the midpoint.

    python bench/soak.py                       # 8 clients, 10 minutes, kill at 5 minutes
    python bench/soak.py --minutes 1 --clients 2 --out /tmp/soak.json
    python bench/soak.py --no-kill --server-args "--pic-policy epic"

It launches ``python -m sgl_pic.launch_server`` in its own process group
(``sgl_pic.cli.server_process``) with a disk tier in a temporary directory (``--disk-dir`` to
name one), then runs ``--clients`` threads until the deadline, each sending a random mix:

- ``plain``: /generate with token ids, no marks (SGLang's exact prefix caching);
- ``chunked:<policy>``: /generate with ids and chunk spans, the policy (and sometimes its
  settings) overridden per request, every policy in turn; a few target the canary's own
  tokens, so approximate KV for exactly its prefix exists;
- ``chat``: /v1/chat/completions with ``pic_chunk`` on messages or content items (half
  streamed);
- ``frontend``: an SGLang frontend program (``sgl.function``) using ``sgl_pic.frontend.chunk``
  against the server (``sgl.RuntimeEndpoint``);
- ``malformed``: one of several bad requests (bad spans, settings, ids, internal keys,
  deep JSON, ...) that must get 400 (oversized bodies are left to tests/integration/
  test_fuzz.py: 64 MiB per request would measure the network, not the server).

Prompts are a system chunk plus 2-6 MuSiQue passages (``../shared/data/musique_dev.json``,
truncated to ``--passage-tokens``) drawn from a pool with Zipf popularity, and a question.

With ``--tenants N``, plain, chunked and chat requests go out as one of N tenants (their
``extra_key`` or ``cache_salt``) or as none, and a probe counts cross-tenant chunk hits,
which must be 0, then deletes the probing tenant's chunks and counts any served again,
which must be 0 too (``bench/soak_tenants.py``); operator deletions of a tenant's
namespace (``POST /pic/delete``) also join the mix.

A dedicated client sends the canary (fixed plain /generate, greedy, 8 tokens, with output
logprobs) every ``--canary-every`` seconds and compares it with the reference it took at
start on the cold cache: tokens equal, logprobs within 1e-4.

Fault: at the midpoint the server's whole process group gets SIGKILL; the disk tier is
scanned with the project's record reader (``sgl_pic.store.format.RecordFile``: header,
key and every payload checksum) before and after, and the server restarts on the same
directory. Requests that fail to connect while it is down count as ``unavailable``; a
server death other than the planned kill is a crash (the server is restarted and the run
goes on). Results go to ``bench/results/soak.json`` (``--out``): git commit and dirtiness,
settings, every request (kind, status, latency, t), canary checks, disk scans, server
events, the last server's chunk metrics and a summary, which is also printed. Exit status
1 on any 5xx, crash, failed restart, canary mismatch or canary error, disk record lost
or corrupt after the kill, cross-tenant chunk hit, deleted chunk served again, or failed
tenant probe.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import requests
from _common import (
    ROOT,
    add_data_option,
    add_out_option,
    add_server_args_option,
    embedded_tokenizer,
    git_state,
    percentile,
    server_env,
    write_json,
)
from _server import STARTUP_TIMEOUT_S
from soak_tenants import ProbeResult, Quiesce, probe, salt
from soak_tenants import summarize as summarize_tenants

POLICIES = ("full_recompute", "full_reuse", "epic", "cacheblend", "daric", "cachetune")
APPROXIMATE = POLICIES[1:]
JSON_HEADERS = {"content-type": "application/json"}
LOGPROB_TOL = 1e-4
VOCAB = 49152  # the embedded SmolLM2's vocabulary
# Kinds of client request and their weights in the mix.
MIX = {"plain": 2, "chunked": 5, "chat": 2, "frontend": 1, "malformed": 1}
# With tenants, operator deletions of one tenant's namespace join the mix (POST /pic/delete
# while requests of every tenant are in flight).
DELETE_WEIGHT = 0.2
# Outcomes that are no error: a valid request answered 200, a malformed one refused with
# 400/413, a request that found the server down during an outage.
FINE = frozenset({"ok", "rejected", "unavailable"})


class Record(NamedTuple):
    """One request.

    status:   HTTP status (0: no answer).
    t:        seconds since the run began (before the first launch), at sending.
    outcome:  ok | rejected (malformed, answered 400/413) | unavailable (server down) |
              5xx | refused_valid (a valid request got 4xx) | accepted_malformed |
              wrong_4xx | stream_error | connection_error | timeout |
              frontend_error (the frontend program raised).
    """

    kind: str
    sub: str  # the variant: malformed form, chat stream or not, ...
    status: int
    latency: float  # seconds
    t: float
    client: int
    outcome: str
    error: str


class CanaryCheck(NamedTuple):
    t: float
    outcome: str  # match | mismatch | unavailable | error
    detail: str


class ServerEvent(NamedTuple):
    t: float
    what: str  # started | killed | crashed | stopped
    detail: str


@dataclass(frozen=True)
class DiskScan:
    """A pass over the disk tier: every record file read whole through the project's own
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


# ---------------------------------------------------------------------------- the server


class ServerManager:
    """The server under test: launched through ``sgl_pic.cli.server_process`` (its own process
    group), killed with SIGKILL on request, restarted on the same arguments (and so the
    same disk tier). ``up`` is set while a healthy server is serving ``url``."""

    def __init__(self, args: list[str], t0: Callable[[], float]) -> None:
        self.args = args
        self._now = t0
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
        self.up = threading.Event()
        self.planned_outage = False
        self.events: list[ServerEvent] = []

    def start(self) -> None:
        from sgl_pic.cli.server_process import server_process

        env = server_env()
        stack = ExitStack()
        t0 = time.monotonic()
        proc = stack.enter_context(
            server_process(
                self.args,
                STARTUP_TIMEOUT_S,
                env=env,
                cwd=str(ROOT),
                log_prefix="sgl_pic_soak_server_",
            )
        )
        with self._lock:
            self._stack = stack
            self.url, self.pid = proc.url, proc.pid
            self.log_paths.append(proc.log_path)
            self.generation += 1
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
        self.events.append(ServerEvent(round(self._now(), 2), what, detail))
        print(f"[{self._now():7.1f} s] server {what}: {detail}", flush=True)

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
        self.up.clear()
        self._close()
        self.event("stopped", "end of run")

    def log_tail(self, n: int = 40) -> str:
        from sgl_pic.cli.server_process import log_tail

        return log_tail(self.log_paths[-1], n) if self.log_paths else ""


# ----------------------------------------------------------------------------- requests


class Passage(NamedTuple):
    text: str  # as truncated
    ids: list[int]  # PASSAGE_TEMPLATE-formatted, tokenized on its own


class Workload:
    """Prompts over a Zipf-popular passage pool; everything tokenized up front, so client
    threads never share the (not thread-safe) fast tokenizer."""

    def __init__(self, data: Path, pool: int, passage_tokens: int, zipf: float, seed: int):
        from sgl_pic.prompts import (
            PASSAGE_TEMPLATE,
            QUESTION_TEMPLATE,
            SYSTEM_TEXT,
            load_rag_examples,
            truncate_tokens,
        )

        tok = embedded_tokenizer()
        self.tokenizer = tok

        def ids(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        # The tenant probe tokenizes its fresh chunks (on its one thread) with it.
        self.ids = ids

        examples = load_rag_examples(data)
        rng = random.Random(seed)
        texts = [p for ex in examples for p in ex.passages]
        rng.shuffle(texts)  # popularity independent of the file's order
        texts = texts[:pool]
        self.passages = []
        for t in texts:
            cut = truncate_tokens(tok, t, passage_tokens)
            self.passages.append(Passage(cut, ids(PASSAGE_TEMPLATE.format(text=cut))))
        self.weights = [1.0 / (rank + 1) ** zipf for rank in range(len(self.passages))]
        self.questions = [ex.question for ex in examples]
        self.tails = [ids(QUESTION_TEMPLATE.format(question=q)) for q in self.questions]
        self.system = ids(SYSTEM_TEXT)
        self.passage_template = PASSAGE_TEMPLATE
        # The canary: system, the two most popular passages, the first question, so the
        # chunked traffic touches exactly its tokens most often.
        self.canary_ids, self.canary_spans = self.compose([0, 1], 0)

    def draw(self, rng: random.Random) -> tuple[list[int], int]:
        """2-6 distinct passages by popularity, and a question."""
        k = rng.randint(2, 6)
        chosen: list[int] = []
        while len(chosen) < k:
            i = rng.choices(range(len(self.passages)), weights=self.weights)[0]
            if i not in chosen:
                chosen.append(i)
        return chosen, rng.randrange(len(self.questions))

    def compose(self, chosen: list[int], q: int) -> tuple[list[int], list[list[int]]]:
        """Ids and chunk spans: the system chunk, one chunk per passage, the question."""
        out = list(self.system)
        spans = [[0, len(out)]]
        for i in chosen:
            p = self.passages[i].ids
            spans.append([len(out), len(out) + len(p)])
            out += p
        return out + self.tails[q], spans


def _random_config(rng: random.Random, policy: str) -> dict[str, Any]:
    """The policy, and half the time valid settings of it (small, so requests stay short)."""
    config: dict[str, Any] = {"policy": policy}
    if rng.random() < 0.5:
        if policy == "epic":
            config["epic_k"] = rng.randint(0, 64)
        elif policy == "cacheblend":
            config["cacheblend_ratio"] = round(rng.uniform(0.05, 1.0), 3)
        elif policy == "daric":
            config.update(daric_r=round(rng.uniform(0.02, 1.0), 3), daric_n_avg=rng.randint(1, 64))
            config["daric_mtaf"] = rng.choice(["linear", "log", "exp"])
        elif policy == "cachetune":
            config["cachetune_r"] = round(rng.uniform(0.05, 1.0), 3)
    return config


def _malformed(w: Workload, rng: random.Random, n: int) -> tuple[str, str, bytes]:
    """(form, path, body) of a request the server must refuse with 400."""
    chosen, q = w.draw(rng)
    ids, spans = w.compose(chosen, q)
    sp = {"temperature": 0, "max_new_tokens": n}
    form = rng.choice(
        [
            "overlap",
            "out_of_range",
            "too_short",
            "unknown_policy",
            "bool_setting",
            "n_avg_zero",
            "nan_budget",
            "pic_chunk_yes",
            "out_of_vocab",
            "internal_custom_params",
            "internal_extra_key",
            "unbalanced",
            "batch_delimiter",
            "deep_json",
        ]
    )
    gen: dict[str, Any] = {"input_ids": ids, "pic": {"chunks": spans}, "sampling_params": sp}
    path, body = "/generate", gen
    if form == "overlap":
        gen["pic"]["chunks"] = [*spans, [spans[1][0] + 1, spans[1][1] + 1]]
    elif form == "out_of_range":
        gen["pic"]["chunks"] = [*spans, [len(ids) - 2, len(ids) + 5]]
    elif form == "too_short":
        gen["pic"]["chunks"] = [[0, 2]]
    elif form == "unknown_policy":
        gen["pic"]["config"] = {"policy": "nope"}
    elif form == "bool_setting":
        gen["pic"]["config"] = {"policy": "epic", "epic_k": True}
    elif form == "n_avg_zero":
        gen["pic"]["config"] = {"policy": "daric", "daric_n_avg": 0}
    elif form == "nan_budget":
        gen["pic"]["config"] = {"policy": "daric", "daric_n_avg": math.nan}
    elif form == "pic_chunk_yes":
        path = "/v1/chat/completions"
        body = {
            "model": "default",
            "max_tokens": n,
            "messages": [
                {"role": "user", "content": w.passages[chosen[0]].text, "pic_chunk": "yes"},
                {"role": "user", "content": w.questions[q]},
            ],
        }
    elif form == "out_of_vocab":
        body = {"input_ids": [*ids[:-1], VOCAB + rng.randint(0, 10**6)], "sampling_params": sp}
    elif form == "internal_custom_params":
        sp = {**sp, "custom_params": {"sgl_pic_chunks": [0, 8], "sgl_pic_num_tokens": len(ids)}}
        body = {"input_ids": ids, "sampling_params": sp}
    elif form == "internal_extra_key":
        body = {"input_ids": ids, "sampling_params": sp, "extra_key": "sgl_pic:"}
    elif form == "unbalanced":
        body = {"text": "<|pic_chunk|>" + w.passages[chosen[0]].text, "sampling_params": sp}
    elif form == "batch_delimiter":
        text = "<|pic_chunk|>" + w.passages[chosen[0]].text + "<|pic_chunk|> Q?"
        body = {"text": [text, w.questions[q]], "sampling_params": sp}
    else:
        return form, path, b'{"text": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    return form, path, json.dumps(body, allow_nan=True).encode()


class Client:
    """One client thread: sends the mix until ``deadline``, appending ``Record``s."""

    def __init__(self, idx: int, run: Soak) -> None:
        self.idx = idx
        self.run = run
        self.rng = random.Random(run.args.seed * 1000 + idx)
        self.session = requests.Session()

    def loop(self) -> None:
        mix = {**MIX, "delete": DELETE_WEIGHT} if self.run.args.tenants else MIX
        kinds, weights = zip(*mix.items(), strict=True)
        while time.monotonic() < self.run.deadline:
            kind = self.rng.choices(kinds, weights=weights)[0]
            rec = getattr(self, "_" + kind)()
            self.run.add(rec)
            if rec.outcome in ("unavailable", "connection_error"):
                time.sleep(1.0)  # the server is down: do not spin

    # Each sender returns one Record.

    def _plain(self) -> Record:
        w = self.run.workload
        ids, _ = w.compose(*w.draw(self.rng))
        body = {"input_ids": ids, "sampling_params": self.run.sampling()}
        sub = "ids" + self._salt(body, chat=False)
        return self.run.post(self, "plain", sub, "/generate", body, valid=True)

    def _salt(self, body: dict[str, Any], chat: bool) -> str:
        """A tenant's key or salt on ``body`` with ``--tenants``: the record's sub-suffix."""
        how = salt(body, self.rng, self.run.args.tenants, chat)
        return f"+{how}" if how else ""

    def _chunked(self) -> Record:
        w = self.run.workload
        policy = self.rng.choice(POLICIES)
        if self.rng.random() < 0.1:
            ids, spans, sub = w.canary_ids, w.canary_spans, "canary_tokens"
            policy = self.rng.choice(APPROXIMATE)
        else:
            (ids, spans), sub = w.compose(*w.draw(self.rng)), "pool"
        body = {
            "input_ids": ids,
            "pic": {"chunks": spans, "config": _random_config(self.rng, policy)},
            "sampling_params": self.run.sampling(),
        }
        sub += self._salt(body, chat=False)
        return self.run.post(self, "chunked:" + policy, sub, "/generate", body, valid=True)

    def _chat(self) -> Record:
        w = self.run.workload
        chosen, q = w.draw(self.rng)
        docs = [w.passage_template.format(text=w.passages[i].text) for i in chosen]
        if self.rng.random() < 0.5:
            messages: list[dict[str, Any]] = [
                *({"role": "user", "content": d, "pic_chunk": True} for d in docs),
                {"role": "user", "content": "Question: " + w.questions[q]},
            ]
        else:
            items = [{"type": "text", "text": d, "pic_chunk": True} for d in docs]
            items.append({"type": "text", "text": "Question: " + w.questions[q]})
            messages = [{"role": "user", "content": items}]
        stream = self.rng.random() < 0.5
        body: dict[str, Any] = {
            "model": "default",
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.run.args.max_new_tokens,
            "stream": stream,
        }
        if self.rng.random() < 0.5:
            body["pic"] = {"config": _random_config(self.rng, self.rng.choice(POLICIES))}
        sub = ("stream" if stream else "whole") + self._salt(body, chat=True)
        return self.run.post(self, "chat", sub, "/v1/chat/completions", body, valid=True)

    def _delete(self) -> Record:
        """The operator deletes one tenant's chunks (``--tenants``) amid the mix."""
        field = self.rng.choice(["extra_key", "cache_salt"])
        tenant = f"tenant-{self.rng.randrange(self.run.args.tenants)}"
        body = {"namespace": {field: tenant}}
        with self.run.deleting:
            return self.run.post(self, "delete", field, "/pic/delete", body, valid=True)

    def _malformed(self) -> Record:
        form, path, raw = _malformed(self.run.workload, self.rng, self.run.args.max_new_tokens)
        return self.run.post(self, "malformed", form, path, raw, valid=False)

    def _frontend(self) -> Record:
        w = self.run.workload
        chosen, q = w.draw(self.rng)
        docs = [w.passages[i].text for i in chosen]
        t_send = self.run.now()
        gen, up = self.run.server.generation, self.run.server.up.is_set()
        t0 = time.perf_counter()
        try:
            with self.run.quiesce.request():
                backend = self.run.backend()
                state = self.run.program.run(
                    docs=docs,
                    question=w.questions[q],
                    max_new_tokens=self.run.args.max_new_tokens,
                    temperature=0,
                    backend=backend,
                )
            err = state.error()
            if err is None and not isinstance(state["answer"], str):
                err = RuntimeError("no answer")
        except Exception as e:  # noqa: BLE001 - the frontend raises what urllib raises
            err = e
        dt = time.perf_counter() - t0
        if err is None:
            return Record("frontend", "program", 200, dt, t_send, self.idx, "ok", "")
        msg = f"{type(err).__name__}: {str(err)[:300]}"
        down = self.run.outage(gen, up)
        outcome = "unavailable" if down and _is_connection(err) else "frontend_error"
        return Record("frontend", "program", 0, dt, t_send, self.idx, outcome, msg)


def _is_connection(err: BaseException) -> bool:
    import urllib.error

    text = str(err)
    return isinstance(err, urllib.error.URLError | ConnectionError | requests.ConnectionError) or (
        "Connection refused" in text or "Connection reset" in text
    )


def _frontend_program() -> Any:
    import sglang as sgl

    from sgl_pic.frontend import chunk
    from sgl_pic.prompts import PASSAGE_TEMPLATE

    @sgl.function
    def qa(s: Any, docs: list[str], question: str) -> None:
        for d in docs:
            s += chunk(PASSAGE_TEMPLATE.format(text=d))
        # max_new_tokens and temperature come from run().
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer")

    return qa


class Soak:
    """The run: shared state of clients, canary, fault injection and results."""

    def __init__(self, args: argparse.Namespace, workload: Workload, server_args: list[str]):
        self.args = args
        self.workload = workload
        self.records: list[Record] = []
        self.canary: list[CanaryCheck] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.deadline = math.inf
        self.server = ServerManager(server_args, self.now)
        self.program = _frontend_program()
        self._backends: dict[str, Any] = {}
        self.reference: tuple[list[int], list[float]] | None = None
        self.crashes = 0
        # Requests of the mix hold it while in flight; the tenant probe runs alone.
        self.quiesce = Quiesce()
        # Held by deletions (the mix's and the probe's) and by the planned kill's disk
        # scans, so no record a deletion removes reads as lost to the kill.
        self.deleting = threading.Lock()
        self.probes: list[ProbeResult] = []

    def now(self) -> float:
        return time.monotonic() - self._t0

    def sampling(self) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": self.args.max_new_tokens}

    def add(self, rec: Record) -> None:
        with self._lock:
            self.records.append(rec)

    def outage(self, gen_at_send: int, up_at_send: bool) -> bool:
        """Whether a request sent in that state may have met a server that is down."""
        return (
            not up_at_send or not self.server.up.is_set() or self.server.generation != gen_at_send
        )

    def backend(self) -> Any:
        """An SGLang RuntimeEndpoint for the current server (one per URL: it reads the
        model's info at construction)."""
        import sglang as sgl

        url = self.server.url
        with self._lock:
            b = self._backends.get(url)
        if b is None:
            b = sgl.RuntimeEndpoint(url)
            with self._lock:
                self._backends[url] = b
        return b

    def post(
        self, client: Client, kind: str, sub: str, path: str, body: Any, valid: bool
    ) -> Record:
        data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        stream = isinstance(body, dict) and bool(body.get("stream"))
        gen, up = self.server.generation, self.server.up.is_set()
        url = self.server.url
        t_send = self.now()
        t0 = time.perf_counter()
        status, err = 0, ""
        try:
            with (
                self.quiesce.request(),
                client.session.post(
                    url + path,
                    data=data,
                    headers=JSON_HEADERS,
                    timeout=self.args.timeout,
                    stream=stream,
                ) as r,
            ):
                status = r.status_code
                if stream and status == 200:
                    events = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
                    if (
                        not events
                        or events[-1] != "data: [DONE]"
                        or any('"error"' in e for e in events)
                    ):
                        err = "stream error: " + " | ".join(events[-3:])[:300]
                else:
                    text = r.text
                    if status != 200 or not valid:
                        err = text[:300]
        except requests.Timeout as e:
            dt = time.perf_counter() - t0
            return Record(kind, sub, 0, dt, t_send, client.idx, "timeout", str(e)[:300])
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            dt = time.perf_counter() - t0
            if self.outage(gen, up):
                outcome = "unavailable"
                why = "planned kill" if self.server.planned_outage else "crash"
                msg = f"{why}: {type(e).__name__}: {str(e)[:200]}"
            else:
                outcome, msg = "connection_error", f"{type(e).__name__}: {str(e)[:200]}"
            return Record(kind, sub, 0, dt, t_send, client.idx, outcome, msg)
        dt = time.perf_counter() - t0
        if status >= 500:
            outcome = "5xx"
        elif valid:
            outcome = "refused_valid" if status != 200 else "stream_error" if err else "ok"
        elif status in (400, 413):
            outcome, err = "rejected", ""
        else:
            outcome = "accepted_malformed" if status < 400 else "wrong_4xx"
        return Record(kind, sub, status, dt, t_send, client.idx, outcome, err)

    # ---------------------------------------------------------------------- the canary

    def canary_body(self) -> dict[str, Any]:
        return {
            "input_ids": self.workload.canary_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "return_logprob": True,
        }

    def send_canary(self) -> tuple[list[int], list[float]]:
        r = requests.post(
            self.server.url + "/generate", json=self.canary_body(), timeout=self.args.timeout
        )
        if r.status_code != 200:
            raise RuntimeError(f"canary answered {r.status_code}: {r.text[:300]}")
        lp = r.json()["meta_info"]["output_token_logprobs"]
        return [int(x[1]) for x in lp], [float(x[0]) for x in lp]

    def check_canary(self) -> CanaryCheck:
        assert self.reference is not None
        gen, up = self.server.generation, self.server.up.is_set()
        t = self.now()
        try:
            tokens, logprobs = self.send_canary()
        except requests.RequestException as e:
            outcome = "unavailable" if self.outage(gen, up) else "error"
            return CanaryCheck(t, outcome, f"{type(e).__name__}: {str(e)[:200]}")
        except RuntimeError as e:
            return CanaryCheck(t, "error", str(e))
        ref_tokens, ref_lp = self.reference
        if tokens != ref_tokens:
            return CanaryCheck(t, "mismatch", f"tokens {tokens} != reference {ref_tokens}")
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_lp, strict=True))
        if not worst <= LOGPROB_TOL:
            return CanaryCheck(t, "mismatch", f"logprobs differ by {worst:.3g}")
        return CanaryCheck(t, "match", f"max logprob diff {worst:.2g}")

    def canary_loop(self) -> None:
        while time.monotonic() < self.deadline:
            check = self.check_canary()
            with self._lock:
                self.canary.append(check)
            if check.outcome == "mismatch":
                print(f"[{check.t:7.1f} s] CANARY MISMATCH: {check.detail}", flush=True)
            end = time.monotonic() + self.args.canary_every
            while time.monotonic() < min(end, self.deadline):
                time.sleep(0.5)

    def probe_loop(self) -> None:
        """The tenant probe every ``--tenant-probe-every`` seconds (``soak_tenants``)."""
        w = self.workload
        texts = [p.text for p in w.passages]
        n = 0
        while time.monotonic() < self.deadline:
            end = time.monotonic() + self.args.tenant_probe_every
            while time.monotonic() < min(end, self.deadline):
                time.sleep(0.5)
            if time.monotonic() >= self.deadline or not self.server.up.is_set():
                continue
            n += 1
            with self.deleting, self.quiesce.alone():
                result = probe(
                    self.server.url, n, w.ids, texts, w.tails[0], self.args.timeout, self.now()
                )
            with self._lock:
                self.probes.append(result)
            if result.outcome != "ok":
                print(f"[{result.t:7.1f} s] tenant probe: {result.outcome} {result.detail}")

    # ------------------------------------------------------------------ crash watcher

    def watch(self, stop: threading.Event) -> None:
        """Restart the server when it dies outside the planned kill (a crash)."""
        s = self.server
        while not stop.wait(1.0):
            with s.lifecycle:
                if s.up.is_set() and not s.alive():
                    self.crashes += 1
                    s.event("crashed", "server died unplanned; log tail:\n" + s.log_tail(30))
                    s.kill9(planned=False)  # the rest of its group, and the launcher's handle
                    if time.monotonic() < self.deadline:
                        s.restart()


def summarize(soak: Soak, scans: dict[str, DiskScan], restart_errors: dict[str, Any]) -> dict:
    recs = soak.records
    by_outcome = Counter(r.outcome for r in recs)
    errors: dict[str, Counter[str]] = defaultdict(Counter)
    for r in recs:
        if r.outcome not in FINE:
            errors[r.kind][r.outcome] += 1
    latency: dict[str, dict[str, float]] = {}
    groups: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        if r.outcome in ("ok", "rejected"):
            groups[r.kind].append(r.latency)
    for kind in sorted(groups):
        v = groups[kind]
        latency[kind] = {
            "n": len(v),
            "p50_s": round(percentile(v, 0.5), 4),
            "p99_s": round(percentile(v, 0.99), 4),
        }
    before, after = scans.get("before_kill"), scans.get("after_kill")
    disk: dict[str, Any] = {k: s.summary() for k, s in scans.items()}
    if before is not None and after is not None:
        lost = sorted(before.valid - after.valid)
        disk["lost_after_kill"] = len(lost)
        disk["lost_files"] = lost[:20]
        disk["corrupt_after_kill"] = len(after.bad)
        disk["tmp_files_after_kill"] = len(after.tmp_files)
    # sgl_pic_store_errors_total series of the restarted server's /metrics after its index
    # rebuild ({}: none counted).
    disk["store_errors_counted_by_restarted_server"] = restart_errors
    canary = Counter(c.outcome for c in soak.canary)
    return {
        "requests": len(recs),
        "by_outcome": dict(by_outcome),
        "errors_by_kind": {k: dict(v) for k, v in sorted(errors.items())},
        "5xx": by_outcome.get("5xx", 0),
        "crashes": soak.crashes,
        "restart_failures": soak.server.restart_failures,
        "canary_checks": len(soak.canary),
        "canary_by_outcome": dict(canary),
        "canary_mismatches": canary.get("mismatch", 0),
        # A canary that got no usable answer while the server was up (5xx, bad JSON, ...).
        "canary_errors": canary.get("error", 0),
        "disk": disk,
        "latency": latency,
        **({"tenants": summarize_tenants(soak.probes)} if soak.args.tenants else {}),
    }


def _pic_metrics(url: str, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """The server's sgl_pic_* series whose names start with one of ``prefixes``."""
    try:
        text = requests.get(url + "/metrics", timeout=60).text
    except requests.RequestException as e:
        return {"metrics_error": str(e)[:200]}
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith(prefixes) and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# Read from the last server at the end: did chunks come back from the disk tier after the
# restart, and did the chunk path fail or fall back?
FINAL_METRICS = (
    "sgl_pic_tier_hits_total",
    "sgl_pic_chunk_misses_total",
    "sgl_pic_failures_total",
    "sgl_pic_fallbacks_total",
    "sgl_pic_store_errors_total",
    "sgl_pic_requests_total",
)


def print_summary(s: dict[str, Any]) -> None:
    print("\n=== soak summary ===")
    print(f"requests {s['requests']}  outcomes {s['by_outcome']}")
    print(f"5xx {s['5xx']}  crashes {s['crashes']}  canary {s['canary_by_outcome']}")
    if "tenants" in s:
        print(f"tenants: {json.dumps(s['tenants'])}")
    for kind, errs in s["errors_by_kind"].items():
        print(f"  errors {kind}: {errs}")
    d = s["disk"]
    for k in ("before_kill", "after_kill"):
        if k in d:
            counts = {x: d[k][x] for x in ("files", "valid", "bad", "tmp_files")}
            print(f"disk {k}: {json.dumps(counts)}")
    if "lost_after_kill" in d:
        print(
            f"disk: lost {d['lost_after_kill']}, corrupt {d['corrupt_after_kill']}, "
            f"tmp files {d['tmp_files_after_kill']}; restarted server counted "
            f"{d['store_errors_counted_by_restarted_server']}"
        )
    print(f"{'kind':28s} {'n':>6s} {'p50 s':>8s} {'p99 s':>8s}")
    for kind, v in s["latency"].items():
        print(f"{kind:28s} {v['n']:6d} {v['p50_s']:8.3f} {v['p99_s']:8.3f}")


@contextmanager
def _disk_dir(path: str | None) -> Iterator[Path]:
    if path:
        yield Path(path)
        return
    tmp = tempfile.mkdtemp(prefix="sgl_pic_soak_disk_")
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    add_out_option(ap, "soak.json")
    ap.add_argument("--no-kill", action="store_true", help="no kill -9 at the midpoint")
    add_data_option(ap)
    ap.add_argument("--pool", type=int, default=64, help="passages in the pool")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of popularity")
    ap.add_argument("--passage-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--canary-every", type=float, default=20.0, help="seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disk-dir", default=None, help="disk tier (default: a temporary one)")
    add_server_args_option(ap)
    ap.add_argument(
        "--tenants", type=int, default=0, help="tenants mixed in (0: none; >= 2 probes them)"
    )
    ap.add_argument(
        "--tenant-probe-every", type=float, default=30.0, help="seconds between tenant probes"
    )
    args = ap.parse_args()
    # SGLang's frontend warns with a traceback on every failed request (while the server
    # is down: dozens); each is recorded as a Record already.
    warnings.filterwarnings("ignore", message="Error in stream_executor")

    commit, dirty = git_state()
    workload = Workload(Path(args.data), args.pool, args.passage_tokens, args.zipf, args.seed)
    scans: dict[str, DiskScan] = {}
    restart_errors: dict[str, Any] = {}
    final_metrics: dict[str, Any] = {}
    with _disk_dir(args.disk_dir) as disk:
        server_args = [*shlex.split(args.server_args), "--pic-disk-cache-dir", str(disk)]
        soak = Soak(args, workload, server_args)
        soak.server.start()
        try:
            # Cold cache: nothing but the launcher's warm-up has run.
            soak.reference = soak.send_canary()
            print(f"canary reference: {soak.reference[0]}", flush=True)
            clients_t = soak.now()
            soak.deadline = time.monotonic() + args.minutes * 60
            stop = threading.Event()
            threads = [
                threading.Thread(target=Client(i, soak).loop, name=f"client{i}", daemon=True)
                for i in range(args.clients)
            ]
            threads.append(threading.Thread(target=soak.canary_loop, name="canary", daemon=True))
            if args.tenants >= 2:
                threads.append(
                    threading.Thread(target=soak.probe_loop, name="tenant-probe", daemon=True)
                )
            watcher = threading.Thread(target=soak.watch, args=(stop,), daemon=True)
            for t in [*threads, watcher]:
                t.start()
            if not args.no_kill:
                time.sleep(max(0.0, soak.deadline - args.minutes * 30 - time.monotonic()))
                with soak.server.lifecycle, soak.deleting:
                    scans["before_kill"] = scan_disk(disk, soak.now())
                    soak.server.kill9(planned=True)
                    soak.server.event("killed", f"SIGKILL to process group {soak.server.pid}")
                    # Before the restart: start-up would delete bad files and old temp files.
                    scans["after_kill"] = scan_disk(disk, soak.now())
                    if soak.server.restart():
                        restart_errors = _pic_metrics(
                            soak.server.url, ("sgl_pic_store_errors_total",)
                        )
            for t in threads:
                t.join()
            stop.set()
            watcher.join()
            # One more canary after the run: the restarted server must match too.
            final = soak.check_canary()
            soak.canary.append(final)
            print(f"final canary: {final.outcome} {final.detail}", flush=True)
            if soak.server.up.is_set():
                final_metrics = _pic_metrics(soak.server.url, FINAL_METRICS)
        finally:
            soak.server.stop()
        scans["end"] = scan_disk(disk, soak.now())

    summary = summarize(soak, scans, restart_errors)
    result = {
        "git_commit": commit,
        "git_dirty": dirty,
        "settings": {**vars(args), "server_args": server_args, "mix": MIX},
        # Every t is seconds since the run began (before the first launch).
        "clients_started_t": round(clients_t, 2),
        "server_logs": soak.server.log_paths,
        "server_events": [e._asdict() for e in soak.server.events],
        "canary_reference": {"tokens": soak.reference[0], "logprobs": soak.reference[1]}
        if soak.reference
        else None,
        "canary_checks": [c._asdict() for c in soak.canary],
        "tenant_probes": [p._asdict() for p in soak.probes],
        "final_server_metrics": final_metrics,
        "summary": summary,
        "records": [r._asdict() for r in soak.records],
    }
    out = write_json(args.out, result)
    print_summary(summary)
    if final_metrics:
        print(f"last server's chunk metrics: {json.dumps(final_metrics)}")
    print(f"\nwrote {out}")
    d = summary["disk"]
    failed = (
        summary["5xx"]
        or summary["crashes"]
        or summary["restart_failures"]
        or summary["canary_mismatches"]
        or summary["canary_errors"]
        or d.get("lost_after_kill", 0)
        or d.get("corrupt_after_kill", 0)
        or summary.get("tenants", {}).get("cross_tenant_hits", 0)
        or summary.get("tenants", {}).get("deleted_chunk_hits", 0)
        or summary.get("tenants", {}).get("probe_errors", 0)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
