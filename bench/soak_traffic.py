"""The soak's clients (``bench/soak.py``): threads that send the request mix to the
servers until the deadline, and how each request's outcome is recorded.

Kinds and their weights in the mix (``MIX``): plain /generate with ids (SGLang's exact
prefix caching); chunked /generate under each policy in turn (a few on the canary's own
tokens, so approximate KV for exactly its prefix exists); chat with marked chunks; chat
with tool results and documents the server auto-chunks, with a tool schema; an SGLang
frontend program using ``sgl_pic.frontend.chunk``; long chunked or plain prompts over
several prefill pieces; streams the client closes after the first event (mid-request
aborts); malformed requests that must get 400; with tenants, operator deletions.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import requests
from soak_server import ServerManager
from soak_stats import Record, outcome_of
from soak_tenants import Quiesce, salt
from soak_workload import APPROXIMATE, POLICIES, Workload, malformed, random_config

JSON_HEADERS = {"content-type": "application/json"}
MIX = {
    "plain": 2.0,
    "chunked": 5.0,
    "chat": 2.0,
    "chat_tools": 1.0,
    "frontend": 1.0,
    "long": 1.0,
    "abort": 0.5,
    "malformed": 1.0,
}
# With tenants, operator deletions of one tenant's namespace join the mix (POST
# /pic/delete while requests of every tenant are in flight).
DELETE_WEIGHT = 0.2
# Aborted streams ask for more tokens, so the server is still decoding when they close.
ABORT_TOKENS = 64


class Traffic:
    """What the clients share: the servers, the workload, the records, and the locks the
    probes and faults take (``quiesce``: requests hold it while in flight; ``deleting``:
    deletions hold it, so a disk scan never reads a deleted record as lost)."""

    def __init__(
        self,
        args: argparse.Namespace,
        workload: Workload,
        servers: list[ServerManager],
        now: Callable[[], float],
    ) -> None:
        self.args = args
        self.workload = workload
        self.servers = servers
        self.now = now
        self.records: list[Record] = []
        self.deadline = float("inf")
        self.long_passages = 0  # passages of a long prompt (set once the server is up)
        self.quiesce = Quiesce()
        self.deleting = threading.Lock()
        self._lock = threading.Lock()
        self._backends: dict[str, Any] = {}
        self.program = _frontend_program()

    def add(self, rec: Record) -> None:
        with self._lock:
            self.records.append(rec)

    def sampling(self, tokens: int | None = None) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": tokens or self.args.max_new_tokens}

    @staticmethod
    def outage(server: ServerManager, gen_at_send: int, up_at_send: bool) -> bool:
        """Whether a request sent in that state may have met a server that is down."""
        return not up_at_send or not server.up.is_set() or server.generation != gen_at_send

    def backend(self, server: ServerManager) -> Any:
        """An SGLang RuntimeEndpoint for the server's current URL (one per URL: it reads
        the model's info when made)."""
        import sglang as sgl

        url = server.url
        with self._lock:
            b = self._backends.get(url)
        if b is None:
            b = sgl.RuntimeEndpoint(url)
            with self._lock:
                self._backends[url] = b
        return b

    def post(
        self,
        session: requests.Session,
        idx: int,
        server: ServerManager,
        kind: str,
        sub: str,
        path: str,
        body: Any,
        valid: bool,
        abort: bool = False,
    ) -> Record:
        """One request and its record. ``abort``: a stream closed after its first event."""
        data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        stream = isinstance(body, dict) and bool(body.get("stream"))
        gen, up = server.generation, server.up.is_set()
        t_send = self.now()
        t0 = time.perf_counter()
        status, err, aborted = 0, "", False

        def record(status: int, outcome: str, error: str) -> Record:
            dt = time.perf_counter() - t0
            return Record(kind, sub, server.name, status, dt, t_send, idx, outcome, error)

        try:
            with (
                self.quiesce.request(),
                session.post(
                    server.url + path,
                    data=data,
                    headers=JSON_HEADERS,
                    timeout=self.args.timeout,
                    stream=stream,
                ) as r,
            ):
                status = r.status_code
                if stream and status == 200:
                    events = []
                    for line in r.iter_lines(decode_unicode=True):
                        if line:
                            events.append(line)
                            if abort:
                                aborted = True
                                break  # closing the response drops the connection
                    if not aborted and (
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
            return record(0, "timeout", str(e)[:300])
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            if self.outage(server, gen, up):
                why = "planned kill" if server.planned_outage else "down"
                return record(0, "unavailable", f"{why}: {type(e).__name__}: {str(e)[:200]}")
            return record(0, "connection_error", f"{type(e).__name__}: {str(e)[:200]}")
        if aborted:
            return record(status, "aborted", "")
        outcome = outcome_of(status, valid, bool(err))
        return record(status, outcome, "" if outcome == "rejected" else err)


class Client:
    """One client thread: sends the mix until ``deadline``, appending ``Record``s; each
    request goes to a server drawn at random."""

    def __init__(self, idx: int, traffic: Traffic, seed: int) -> None:
        self.idx = idx
        self.traffic = traffic
        self.rng = random.Random(seed * 1000 + idx)
        self.session = requests.Session()
        self.server = traffic.servers[0]

    def loop(self) -> None:
        tr = self.traffic
        mix = {**MIX, "delete": DELETE_WEIGHT} if tr.args.tenants else MIX
        kinds, weights = zip(*mix.items(), strict=True)
        while time.monotonic() < tr.deadline:
            self.server = self.rng.choice(tr.servers)
            rec = self.send(self.rng.choices(kinds, weights=weights)[0])
            tr.add(rec)
            if rec.outcome in ("unavailable", "connection_error"):
                # The server is down: wait for it rather than spin (each wait still
                # leaves one unavailable record per client and few seconds).
                self.server.up.wait(timeout=5.0)

    def send(self, kind: str) -> Record:
        return getattr(self, "_" + kind)()

    def _post(self, kind: str, sub: str, path: str, body: Any, valid: bool = True) -> Record:
        return self.traffic.post(self.session, self.idx, self.server, kind, sub, path, body, valid)

    def _salt(self, body: dict[str, Any], chat: bool) -> str:
        """A tenant's key or salt on ``body`` with ``--tenants``: the record's sub-suffix."""
        how = salt(body, self.rng, self.traffic.args.tenants, chat)
        return f"+{how}" if how else ""

    def _plain(self) -> Record:
        w = self.traffic.workload
        ids, _ = w.compose(*w.draw(self.rng))
        body = {"input_ids": ids, "sampling_params": self.traffic.sampling()}
        return self._post("plain", "ids" + self._salt(body, chat=False), "/generate", body)

    def _chunked_body(self, ids: list[int], spans: list[list[int]], policy: str) -> dict[str, Any]:
        return {
            "input_ids": ids,
            "pic": {"chunks": spans, "config": random_config(self.rng, policy)},
            "sampling_params": self.traffic.sampling(),
        }

    def _chunked(self) -> Record:
        w = self.traffic.workload
        policy = self.rng.choice(POLICIES)
        if self.rng.random() < 0.1:
            ids, spans, sub = w.canary_ids, w.canary_spans, "canary_tokens"
            policy = self.rng.choice(APPROXIMATE)
        else:
            (ids, spans), sub = w.compose(*w.draw(self.rng)), "pool"
        body = self._chunked_body(ids, spans, policy)
        sub += self._salt(body, chat=False)
        return self._post("chunked:" + policy, sub, "/generate", body)

    def _long(self) -> Record:
        """A prompt longer than several prefill pieces, chunked (2 in 3) or plain."""
        w = self.traffic.workload
        ids, spans = w.compose(*w.draw(self.rng, self.traffic.long_passages))
        if self.rng.random() < 2 / 3:
            policy = self.rng.choice(POLICIES)
            body, sub = self._chunked_body(ids, spans, policy), policy
        else:
            body, sub = {"input_ids": ids, "sampling_params": self.traffic.sampling()}, "plain"
        return self._post("long", f"{sub}:{len(ids)}", "/generate", body)

    def _chat(self) -> Record:
        sub, body = self.traffic.workload.marked_chat(self.rng, self.traffic.args.max_new_tokens)
        body.update(temperature=0, stream=self.rng.random() < 0.5)
        if self.rng.random() < 0.5:
            body["pic"] = {"config": random_config(self.rng, self.rng.choice(POLICIES))}
        sub += "+stream" if body["stream"] else "+whole"
        sub += self._salt(body, chat=True)
        return self._post("chat", sub, "/v1/chat/completions", body)

    def _chat_tools(self) -> Record:
        w, n = self.traffic.workload, self.traffic.args.max_new_tokens
        sub, body = w.tool_chat(self.rng, n)
        body.update(temperature=0, stream=self.rng.random() < 0.5)
        sub += self._salt(body, chat=True)
        return self._post("chat_tools", sub, "/v1/chat/completions", body)

    def _abort(self) -> Record:
        """A stream (chat or /generate) closed by the client after its first event."""
        w = self.traffic.workload
        if self.rng.random() < 0.5:
            sub, body = w.marked_chat(self.rng, ABORT_TOKENS)
            body.update(temperature=0, stream=True)
            path = "/v1/chat/completions"
        else:
            ids, spans = w.compose(*w.draw(self.rng))
            body = self._chunked_body(ids, spans, self.rng.choice(POLICIES))
            body.update(sampling_params=self.traffic.sampling(ABORT_TOKENS), stream=True)
            sub, path = "generate", "/generate"
        tr = self.traffic
        return tr.post(self.session, self.idx, self.server, "abort", sub, path, body, True, True)

    def _delete(self) -> Record:
        """The operator deletes one tenant's chunks (``--tenants``) amid the mix."""
        field = self.rng.choice(["extra_key", "cache_salt"])
        tenant = f"tenant-{self.rng.randrange(self.traffic.args.tenants)}"
        with self.traffic.deleting:
            body = {"namespace": {field: tenant}}
            return self._post("delete", field, "/pic/delete", body)

    def _malformed(self) -> Record:
        tr = self.traffic
        form, path, raw = malformed(tr.workload, self.rng, tr.args.max_new_tokens)
        return self._post("malformed", form, path, raw, valid=False)

    def _frontend(self) -> Record:
        tr, server = self.traffic, self.server
        w = tr.workload
        chosen, q = w.draw(self.rng)
        t_send = tr.now()
        gen, up = server.generation, server.up.is_set()
        t0 = time.perf_counter()
        try:
            with tr.quiesce.request():
                state = tr.program.run(
                    docs=[w.passages[i].text for i in chosen],
                    question=w.questions[q],
                    max_new_tokens=tr.args.max_new_tokens,
                    temperature=0,
                    backend=tr.backend(server),
                )
            err = state.error()
            if err is None and not isinstance(state["answer"], str):
                err = RuntimeError("no answer")
        except Exception as e:  # noqa: BLE001 - the frontend raises what urllib raises
            err = e
        dt = time.perf_counter() - t0
        if err is None:
            return Record("frontend", "program", server.name, 200, dt, t_send, self.idx, "ok", "")
        msg = f"{type(err).__name__}: {str(err)[:300]}"
        down = tr.outage(server, gen, up)
        outcome = "unavailable" if down and _is_connection(err) else "frontend_error"
        return Record("frontend", "program", server.name, 0, dt, t_send, self.idx, outcome, msg)


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
