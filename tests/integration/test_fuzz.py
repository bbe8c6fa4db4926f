"""Fuzzing the server's request surface: random valid and malformed requests on every path.

One server for the module. Before any chunked request it records two cold-cache
references: the canary (a fixed plain /generate request, greedy, with output logprobs)
and the plain form of the exact probe (a prompt whose chunked form, under full_recompute,
must give the same output). Each example sends one request (a ``Case``) and then checks
the contract:

- no 5xx, ever; a valid request gets 200, a malformed one 400 (413 for an oversized body);
- /health answers 200 afterwards (the server keeps serving);
- the canary still gives its reference tokens, logprobs within ``LOGPROB_TOL``: no
  approximate KV from chunk reuse reaches a plain request, whatever came before;
- the exact probe (when drawn) matches its plain cold-cache reference the same way.

``test_each_form_once`` sends one example of every form in ``CATALOG`` (each kind of
malformed input on every run; each violation shows as its own failing test);
``test_random_request_sequence`` sends a derandomized hypothesis sequence mixing them.
Shrinking is off: the server's state carries over between examples, so a smaller request
alone would not reproduce a failure; the failure message lists the forms sent before it.

Environment: ``SGL_PIC_FUZZ_EXAMPLES`` (length of the random sequence, 60 by default),
``SGL_PIC_FUZZ_SERVER_ARGS`` (extra server flags, e.g. ``--pic-policy epic``; with
``--pic-disable`` the checks must fail, which shows they can).

The server runs with ``--pic-max-body-mb 1`` so an oversized body costs 1 MiB, not 64.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn

from sgl_pic.registry import POLICIES as REGISTRY
from tests.support.prompts import DOCS, ids
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

EXAMPLES = int(os.environ.get("SGL_PIC_FUZZ_EXAMPLES", "60"))
VOCAB = 49152  # the embedded SmolLM2's vocabulary
DELIM = "<|pic_chunk|>"
MAX_BODY_MB = 1
LOGPROB_TOL = 1e-4
POLICIES = REGISTRY.names()
APPROXIMATE = tuple(p for p in POLICIES if p != "full_recompute")
NUMERIC_SETTINGS = (
    "daric_r",
    "daric_n_avg",
    "daric_max_iters",
    "epic_k",
    "cacheblend_ratio",
    "cachetune_r",
    "qa_ratio",
    "qa_min_tokens",
    "qa_sink_tokens",
    "qa_layers",
)
JSON_HEADERS = {"content-type": "application/json"}
GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
PATHS = (GENERATE, COMPLETIONS, CHAT)
PATH_NAMES = {GENERATE: "generate", COMPLETIONS: "completions", CHAT: "chat"}

Expect = Literal["ok", "bad", "too_large"]

# Passages beyond DOCS, so chunk sets vary but still repeat (repeats exercise the hit paths).
EXTRA_DOCS = (
    "Reykjavik heats most of its houses with water from hot springs under the city.",
    "Timbuktu's libraries kept manuscripts on astronomy, law and medicine for centuries.",
    "Ushuaia is often called the southernmost city in the world, close to Cape Horn.",
    "Petra was carved into rose-red sandstone cliffs by the Nabataeans.",
)
POOL = (*DOCS.values(), *EXTRA_DOCS)
QUESTIONS = (
    "Which city is on the equator?",
    "Where is the midnight sun seen?",
    "Which city has wooden temples?",
    "Name a port with funiculars.",
)
# Plain words for fresh chunks (one token each, mostly), so chunk lengths are predictable.
_WORD_TEXT = (
    "the a river city old stone bridge market north south winter summer light house "
    "road hill tower harbour ship bell garden library school ancient quiet bright long "
    "short green red blue ice fire salt gold iron glass wind rain snow sea lake valley "
    "island temple wall gate square clock train station museum theatre forest field"
)
WORDS = tuple(_WORD_TEXT.split(" "))


class Case(NamedTuple):
    """One request: ``body`` is sent as these exact bytes (NaN literals, raw nesting)."""

    form: str
    path: str
    body: bytes
    expect: Expect
    stream: bool = False
    chunked_transfer: bool = False  # send without Content-Length
    exact_probe: bool = False  # compare with the exact probe's plain reference

    def describe(self) -> str:
        text = self.body[:400].decode(errors="replace")
        more = f"... ({len(self.body)} bytes)" if len(self.body) > 400 else ""
        return f"{self.form} POST {self.path} stream={self.stream}: {text}{more}"


class Answer(NamedTuple):
    """The server's answer. stream_error: a stream began with 200 but carried an error
    event or never finished with [DONE]."""

    status: int  # 0: no answer
    text: str
    stream_error: bool = False


class Reference(NamedTuple):
    """Greedy output tokens and their logprobs."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


class Prompt(NamedTuple):
    """A prompt as pieces: (text, is_chunk)."""

    pieces: tuple[tuple[str, bool], ...]

    def token_ids(self) -> tuple[list[int], list[list[int]]]:
        """Ids with each piece tokenized on its own (as the server does for delimited text),
        and the chunk spans over them."""
        out: list[int] = []
        spans: list[list[int]] = []
        for text, is_chunk in self.pieces:
            t = ids(text)
            if is_chunk:
                spans.append([len(out), len(out) + len(t)])
            out += t
        return out, spans

    def delimited(self) -> str:
        return "".join(DELIM + t + DELIM if c else t for t, c in self.pieces)

    def plain(self) -> str:
        return "".join(t for t, _ in self.pieces)


def _prompt(header: str, docs: tuple[str, ...], question: str) -> Prompt:
    return Prompt(
        ((header, False), *((d + "\n", True) for d in docs), ("Question: " + question, False))
    )


# Fixed prompts: the canary is plain; the probe is sent plain (reference) and chunked.
CANARY = _prompt("Canary line.\n", (DOCS["A"], DOCS["C"]), "Which city is on the equator?")
PROBE = _prompt("Probe memo.\n", (DOCS["B"], DOCS["D"]), "Where is the midnight sun seen?")
REF_SAMPLING = {"temperature": 0, "max_new_tokens": 8}


def _json(obj: Any) -> bytes:
    # allow_nan: NaN and Infinity literals are part of what the fuzzer sends.
    return json.dumps(obj, allow_nan=True).encode()


def _reference_body(toks: list[int], spans: list[list[int]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": toks,
        "sampling_params": dict(REF_SAMPLING),
        "return_logprob": True,
    }
    if spans is not None:
        body["pic"] = {"chunks": spans, "config": {"policy": "full_recompute"}}
    return body


def _reference_of(status: int, text: str) -> Reference:
    assert status == 200, text[:500]
    lp = json.loads(text)["meta_info"]["output_token_logprobs"]  # [[logprob, id, text], ...]
    return Reference(tuple(int(x[1]) for x in lp), tuple(float(x[0]) for x in lp))


def _mismatch(got: Reference, want: Reference) -> str | None:
    """Why ``got`` differs from ``want``, or None when it matches."""
    if got.tokens != want.tokens:
        return f"tokens {list(got.tokens)} != reference {list(want.tokens)}"
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    if not worst <= LOGPROB_TOL:
        return f"logprobs differ by {worst:.3g} (> {LOGPROB_TOL}): {got.logprobs}"
    return None


class Fuzzer:
    """The module's server, its references, and the forms sent so far."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.history: list[str] = []
        self.canary_ids = CANARY.token_ids()[0]
        # Cold cache: nothing chunked has been sent yet (launch gives a fresh disk tier).
        self.canary = self.reference(self.canary_ids)
        self.probe = self.reference(PROBE.token_ids()[0])

    def post(self, path: str, body: bytes, **kw: Any) -> requests.Response:
        return requests.post(
            self.server.url + path, data=body, headers=JSON_HEADERS, timeout=300, **kw
        )

    def reference(self, toks: list[int]) -> Reference:
        r = self.post(GENERATE, _json(_reference_body(toks)))
        return _reference_of(r.status_code, r.text)

    def run(self, case: Case) -> None:
        """Send ``case`` and assert the whole contract after it."""
        t0 = time.monotonic()
        answer = self._send(case)
        self.history.append(f"{case.form}:{answer.status}")

        def ctx() -> str:  # only built when an assertion fails
            return (
                f"\n  request: {case.describe()}\n  answer: {answer.status} {answer.text[:600]}"
                f"\n  earlier forms: {self.history[-12:-1]}"
                f"\n  server log:\n{self.server.log_tail(30)}"
            )

        assert answer.status < 500, "5xx" + ctx()
        want = {"ok": 200, "bad": 400, "too_large": 413}[case.expect]
        assert answer.status == want, f"expected {want} for {case.expect} input" + ctx()
        assert not answer.stream_error, "the stream failed after its 200" + ctx()
        health = requests.get(self.server.url + "/health", timeout=60)
        assert health.status_code == 200, f"/health {health.status_code} after" + ctx()
        if case.exact_probe:
            why = _mismatch(_reference_of(answer.status, answer.text), self.probe)
            assert why is None, f"exact chunked probe differs from plain cold cache: {why}" + ctx()
        why = _mismatch(self.reference(self.canary_ids), self.canary)
        assert why is None, f"canary differs from its cold-cache reference: {why}" + ctx()
        # A slow request is no contract violation, but the module's runtime depends on it.
        if time.monotonic() - t0 > 60:
            print(f"slow example ({time.monotonic() - t0:.0f} s): {case.form}")

    def _send(self, case: Case) -> Answer:
        body: Any = case.body
        if case.chunked_transfer:
            # A generator makes requests send Transfer-Encoding: chunked, no Content-Length,
            # so a size limit that only reads the header is not enough.
            body = (case.body[i : i + (1 << 16)] for i in range(0, len(case.body), 1 << 16))
        try:
            r = self.post(case.path, body, stream=case.stream)
        except requests.ConnectionError as e:
            # E.g. an oversized body answered early and the socket closed while the client
            # was still sending: no status reaches the client, which fails the check.
            return Answer(0, f"connection error: {e}")
        with r:
            if not case.stream or r.status_code != 200:
                return Answer(r.status_code, r.text)
            events = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
        text = "\n".join(events)
        failed = not events or events[-1] != "data: [DONE]" or any('"error"' in e for e in events)
        return Answer(200, text, failed)


@pytest.fixture(scope="module")
def fuzzer() -> Iterator[Fuzzer]:
    extra = shlex.split(os.environ.get("SGL_PIC_FUZZ_SERVER_ARGS", ""))
    with launch("--pic-max-body-mb", str(MAX_BODY_MB), *extra) as server:
        yield Fuzzer(server)


# ---------------------------------------------------------------- strategies: valid parts


def _words(draw: DrawFn, lo: int, hi: int) -> str:
    return " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=lo, max_size=hi)))


@st.composite
def chunk_texts(draw: DrawFn) -> str:
    """Mostly pooled passages (repeats exercise the hit paths), else fresh words (misses)."""
    if draw(st.integers(0, 2)) < 2:
        return draw(st.sampled_from(POOL))
    return _words(draw, 8, 40) + "."


@st.composite
def prompts(draw: DrawFn) -> Prompt:
    """About 30-300 tokens: a header (often one of the fixed prompts', so prefixes are
    shared with them), 1-5 chunks, the question."""
    if draw(st.booleans()):
        header = draw(st.sampled_from(["Canary line.\n", "Probe memo.\n", ""]))
    else:
        header = _words(draw, 2, 6) + "\n"
    docs = tuple(draw(st.lists(chunk_texts(), min_size=1, max_size=5)))
    return _prompt(header, docs, draw(st.sampled_from(QUESTIONS)))


def _float(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


# Valid values, kept small: a budget past the chunk only means recomputing all of it.
VALID_SETTINGS: dict[str, st.SearchStrategy[Any]] = {
    "daric_r": _float(0.01, 1.0),
    "daric_n_avg": _float(1.0, 128.0) | st.integers(1, 128),
    "daric_mtaf": st.sampled_from(["linear", "log", "exp"]),
    "daric_max_iters": st.integers(0, 16),
    "epic_k": st.integers(0, 64),
    "cacheblend_ratio": _float(0.05, 1.0),
    "cachetune_r": _float(0.05, 1.0),
    "qa_ratio": _float(0.05, 1.0),
    "qa_min_tokens": st.integers(0, 64),
    "qa_sink_tokens": st.integers(0, 8),
    "qa_layers": st.integers(1, 16),
}


@st.composite
def configs(draw: DrawFn) -> dict[str, Any] | None:
    """None (server defaults) or overrides: maybe a policy, and up to three settings (of
    any policy: a setting the policy does not read is still valid)."""
    if draw(st.booleans()):
        return None
    keys = draw(st.lists(st.sampled_from(sorted(VALID_SETTINGS)), max_size=3, unique=True))
    out = {k: draw(VALID_SETTINGS[k]) for k in keys}
    if draw(st.booleans()) or not out:
        out["policy"] = draw(st.sampled_from(POLICIES))
    return out


def _max_new_tokens(draw: DrawFn) -> int:
    return draw(st.integers(1, 4))


def _random_ids(draw: DrawFn, lo: int = 50, hi: int = 300) -> list[int]:
    n = draw(st.integers(lo, hi))
    seed = draw(st.integers(0, 2**31))
    # One draw instead of n: a quadratic sequence mod the vocabulary covers it well enough.
    return [(seed + 7919 * i * i + 104729 * i) % VOCAB for i in range(n)]


SURFACES = (
    "generate_ids",
    "generate_text",
    "generate_batch_ids",
    "generate_batch_text",
    "generate_chunked_ids",
    "generate_chunked_text",
    "completions_text",
    "completions_ids",
    "completions_batch_ids",
    "chat_plain",
    "chat_chunked",
)
CHUNKED_SURFACES = ("generate_chunked_ids", "generate_chunked_text", "chat_chunked")
ID_SURFACES = (
    "generate_ids",
    "generate_batch_ids",
    "generate_chunked_ids",
    "completions_ids",
    "completions_batch_ids",
)
BATCH_SURFACES = ("generate_batch_ids", "generate_batch_text", "completions_batch_ids")
STREAM_SURFACES = tuple(s for s in SURFACES if s not in BATCH_SURFACES)


class Request(NamedTuple):
    """A valid request of one surface, before any mutation."""

    surface: str
    path: str
    body: dict[str, Any]
    stream: bool


def _chat_messages(draw: DrawFn, p: Prompt, chunked: bool) -> list[dict[str, Any]]:
    """Chunks marked on whole messages or on text items of a content list."""
    if not chunked:
        return [{"role": "user", "content": p.plain()}]
    if draw(st.booleans()):
        return [
            {"role": "user", "content": t, "pic_chunk": True}
            if c
            else {"role": "user", "content": t}
            for t, c in p.pieces
            if t
        ]
    items = [
        {"type": "text", "text": t, "pic_chunk": True} if c else {"type": "text", "text": t}
        for t, c in p.pieces
        if t
    ]
    return [{"role": "user", "content": items}]


@st.composite
def surface_requests(draw: DrawFn, surface: str, stream: bool | None = None) -> Request:
    """A valid request of ``surface``; streaming drawn when None (never for batches)."""
    if surface in BATCH_SURFACES:
        stream = False
    elif stream is None:
        stream = draw(st.booleans())
    p = draw(prompts())
    n = _max_new_tokens(draw)
    if surface.startswith(("completions", "chat")):
        body: dict[str, Any] = {"model": "default", "max_tokens": n, "temperature": 0}
        if stream:
            body["stream"] = True
        if surface == "completions_text":
            body["prompt"] = p.plain()
        elif surface == "completions_ids":
            body["prompt"] = _random_ids(draw)
        elif surface == "completions_batch_ids":
            body["prompt"] = [_random_ids(draw), p.token_ids()[0]]
        else:
            body["messages"] = _chat_messages(draw, p, surface == "chat_chunked")
            config = draw(configs()) if surface == "chat_chunked" else None
            if config is not None:
                body["pic"] = {"config": config}
        return Request(surface, CHAT if surface.startswith("chat") else COMPLETIONS, body, stream)
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": n}}
    if stream:
        body["stream"] = True
    if surface == "generate_ids":
        body["input_ids"] = p.token_ids()[0] if draw(st.booleans()) else _random_ids(draw)
    elif surface == "generate_text":
        body["text"] = p.plain()
    elif surface == "generate_batch_ids":
        body["input_ids"] = [p.token_ids()[0], _random_ids(draw)]
    elif surface == "generate_batch_text":
        body["text"] = [p.plain(), draw(prompts()).plain()]
    else:
        pic: dict[str, Any] = {}
        if surface == "generate_chunked_ids":
            body["input_ids"], pic["chunks"] = p.token_ids()
        else:
            body["text"] = p.delimited()  # the delimiters alone mark the chunks
        config = draw(configs())
        if config is not None:
            pic["config"] = config
        if pic:
            body["pic"] = pic
    return Request(surface, GENERATE, body, stream)


def on(surfaces: tuple[str, ...], stream: bool | None = None) -> st.SearchStrategy[Request]:
    return st.sampled_from(surfaces).flatmap(lambda s: surface_requests(s, stream))


# ----------------------------------------------------------------------- forms: valid


def valid(surface: str) -> st.SearchStrategy[Case]:
    return surface_requests(surface).map(
        lambda r: Case("valid_" + r.surface, r.path, _json(r.body), "ok", r.stream)
    )


def _exact_probe_case() -> Case:
    """The probe chunked under full_recompute: must equal its plain cold-cache output."""
    toks, spans = PROBE.token_ids()
    body = _json(_reference_body(toks, spans))
    return Case("exact_probe", GENERATE, body, "ok", exact_probe=True)


def exact_probe() -> st.SearchStrategy[Case]:
    return st.builds(_exact_probe_case)  # built at draw time: the tokenizer loads lazily


@st.composite
def poison(draw: DrawFn) -> Case:
    """The canary's or the probe's own tokens chunked under an approximate policy: the KV
    this leaves must never serve the plain canary or the exact probe."""
    toks, spans = draw(st.sampled_from([CANARY, PROBE])).token_ids()
    body = {
        "input_ids": toks,
        "pic": {"chunks": spans, "config": {"policy": draw(st.sampled_from(APPROXIMATE))}},
        "sampling_params": {"temperature": 0, "max_new_tokens": _max_new_tokens(draw)},
    }
    return Case("valid_poison", GENERATE, _json(body), "ok")


EDGE_KINDS = (
    "max_chunks",
    "min_chunk_tokens",
    "input_logprobs",
    "extra_key",
    "pic_chunk_false",
    "unicode",
)


@st.composite
def valid_edges(draw: DrawFn, kind: str) -> Case:
    """Valid requests at the edges of the contract: limits reached but not passed, options
    that change the path a chunked request takes, a user's own namespace."""
    n = _max_new_tokens(draw)
    sp = {"temperature": 0, "max_new_tokens": n}
    path, stream = GENERATE, False
    body: dict[str, Any]
    if kind == "max_chunks":  # exactly --pic-max-chunks chunks of --pic-min-chunk-tokens
        toks = _random_ids(draw, 256 * 4 + 4, 256 * 4 + 20)
        body = {"input_ids": toks, "pic": {"chunks": [[4 * i + 2, 4 * i + 6] for i in range(256)]}}
    elif kind == "min_chunk_tokens":
        toks = _random_ids(draw, 50, 120)
        s = draw(st.integers(0, len(toks) - 4))
        body = {"input_ids": toks, "pic": {"chunks": [[s, s + 4]]}}
    elif kind == "input_logprobs":
        # Input-token logprobs make a chunked request run without reuse (a fallback).
        toks, spans = draw(prompts()).token_ids()
        body = {
            "input_ids": toks,
            "pic": {"chunks": spans, "config": {"policy": draw(st.sampled_from(POLICIES))}},
            "return_logprob": True,
            "logprob_start_len": draw(st.integers(0, 3)),
            "top_logprobs_num": draw(st.integers(0, 3)),
        }
    elif kind == "extra_key":
        # A client's own namespace, on a chunked or a plain request.
        r = draw(on(("generate_chunked_ids", "generate_ids", "chat_chunked", "completions_text")))
        r.body["extra_key"] = draw(st.sampled_from(["tenant-a", "pic", "sglpic", "x:sgl_pic"]))
        return Case("valid_edge_extra_key_" + r.surface, r.path, _json(r.body), "ok", r.stream)
    elif kind == "pic_chunk_false":
        p = draw(prompts())
        path = CHAT
        msgs = [{"role": "user", "content": t, "pic_chunk": c} for t, c in p.pieces if t]
        body = {"model": "default", "messages": msgs, "max_tokens": n, "temperature": 0}
        return Case("valid_edge_pic_chunk_false", path, _json(body), "ok")
    else:
        # Non-ASCII chunks: token boundaries inside multi-byte characters.
        text = draw(
            st.sampled_from(["Zürich liegt am See. ", "東京は日本の首都です。", "🚀🌍 ok "])
        )
        p = _prompt("Unicode.\n", (text * 3, draw(st.sampled_from(POOL))), "Where?")
        stream = draw(st.booleans())
        body = {"text": p.delimited(), "stream": stream}
    body["sampling_params"] = sp
    return Case("valid_edge_" + kind, path, _json(body), "ok", stream)


# ------------------------------------------------------------------- forms: malformed

SPAN_KINDS = (
    "overlap",
    "out_of_range",
    "negative",
    "empty",
    "reversed",
    "too_short",
    "too_many",
    "bool",
    "float",
    "string",
    "not_pair",
    "not_list",
    "null",
)


@st.composite
def bad_spans(draw: DrawFn, kind: str) -> Case:
    """Spans that are no valid layout of the request's ids (or over the server's limits)."""
    body = draw(surface_requests("generate_chunked_ids", False)).body
    n = len(body["input_ids"])
    s = draw(st.integers(0, n - 20))
    spans: Any
    if kind == "overlap":
        spans = [[s, s + 10], [s + draw(st.integers(1, 9)), s + 18]]
    elif kind == "out_of_range":
        spans = [[s, n + draw(st.integers(1, 10**6))]]
    elif kind == "negative":
        spans = [[-draw(st.integers(1, 5)), s + 8]]
    elif kind == "empty":
        spans = [[s, s]]
    elif kind == "reversed":
        spans = [[s + 8, s]]
    elif kind == "too_short":  # under --pic-min-chunk-tokens (4)
        spans = [[s, s + draw(st.integers(1, 3))]]
    elif kind == "too_many":
        # 257 chunks of 4 tokens: each well formed, one more than --pic-max-chunks (256).
        body["input_ids"] = _random_ids(draw, 257 * 4 + 8, 257 * 4 + 40)
        spans = [[4 * i, 4 * i + 4] for i in range(257)]
    elif kind == "bool":  # JSON true is no token index
        spans = draw(st.sampled_from([[[True, s + 8]], [[s, True]], [[False, 8]]]))
    elif kind == "float":
        spans = [[float(s), float(s + 8)]]
    elif kind == "string":
        spans = [[str(s), str(s + 8)]]
    elif kind == "not_pair":
        spans = draw(st.sampled_from([[[s]], [[s, s + 4, s + 8]], [[]], [s, s + 8]]))
    elif kind == "not_list":
        spans = draw(st.sampled_from([f"{s}-{s + 8}", {"0": 8}, 5]))
    else:
        spans = [None]
    body["pic"] = {**body.get("pic", {}), "chunks": spans}
    return Case("bad_spans_" + kind, GENERATE, _json(body), "bad")


TEXT_KINDS = ("unbalanced", "empty_chunk", "too_short", "text_and_chunks")


@st.composite
def bad_text_marks(draw: DrawFn, kind: str) -> Case:
    """Delimiters in a /generate text that make no valid layout."""
    p = draw(prompts())
    body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 1}}
    if kind == "unbalanced":
        body["text"] = p.delimited() + DELIM + "dangling"
    elif kind == "empty_chunk":
        body["text"] = p.plain() + DELIM + DELIM + "tail"
    elif kind == "too_short":
        body["text"] = p.plain() + DELIM + draw(st.sampled_from(["a", "ok", "the sea"])) + DELIM
    else:
        body["text"] = p.delimited()
        body["pic"] = {"chunks": [[0, 4]]}
    return Case("bad_text_" + kind, GENERATE, _json(body), "bad")


BATCH_KINDS = ("text_delimiter", "ids_chunks")


@st.composite
def bad_batches(draw: DrawFn, kind: str) -> Case:
    """Chunk marks in a batch: one of its texts holds the delimiter, or batch ids carry
    spans."""
    p = draw(prompts())
    body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 1}}
    if kind == "text_delimiter":
        texts = [p.plain(), p.delimited()]
        body["text"] = texts[::-1] if draw(st.booleans()) else texts
    else:
        toks, spans = p.token_ids()
        body.update(input_ids=[toks, toks], pic={"chunks": spans})
    return Case("bad_batch_" + kind, GENERATE, _json(body), "bad")


CONFIG_KINDS = (
    "unknown_policy",
    "unknown_setting",
    "n_avg_zero",
    "bad_mtaf",
    "not_object",
    "pic_not_object",
    "pic_unknown_field",
    "bool",
    "nan",
    "negative",
    "huge",
    "string",
    "null_or_list",
)
BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool": st.booleans(),
    "nan": st.sampled_from([math.nan, math.inf, -math.inf]),
    "negative": st.sampled_from([-1, -0.5, -1e-9, -(10**6)]),
    "huge": st.sampled_from([1e300, 10**30, 2**21, 2**63, 1e20]),
    "string": st.sampled_from(["0.5", "", "32"]),
    "null_or_list": st.sampled_from([None, [], {}, [0.5]]),
}
FRACTIONS = ("daric_r", "cacheblend_ratio", "cachetune_r", "qa_ratio")


@st.composite
def bad_configs(draw: DrawFn, kind: str, surface: str) -> Case:
    """Per-request overrides the server must refuse."""
    r = draw(surface_requests(surface))
    body = r.body
    pic: Any = dict(body.get("pic", {}))
    config: Any = dict(pic.get("config") or {})
    if kind == "unknown_policy":
        config["policy"] = draw(st.sampled_from(["nope", "DARIC", "", "full-reuse", 3]))
    elif kind == "unknown_setting":
        # Server-only settings too: they change how chunks are keyed, bounded or ranked.
        names = [
            "page_size",
            "segment_tokens",
            "delimiter",
            "max_chunks",
            "min_chunk_tokens",
            "cachetune_alpha",
        ]
        config[draw(st.sampled_from([*names, "x"]))] = 4
    elif kind == "n_avg_zero":
        config["daric_n_avg"] = draw(st.sampled_from([0, 0.0]))
    elif kind == "bad_mtaf":
        config["daric_mtaf"] = draw(st.sampled_from(["cubic", "", 1]))
    elif kind == "not_object":
        config = draw(st.sampled_from([[], "epic", 1]))
    elif kind == "pic_not_object":
        pic = draw(st.sampled_from([[], "yes", 1, True]))
    elif kind == "pic_unknown_field":
        pic["chunkz"] = [[0, 4]]
    else:
        # The contract's own examples come first (a derandomized single draw takes them).
        first = "epic_k" if kind in ("bool", "negative") else "daric_n_avg"
        key = draw(st.sampled_from([first, *(k for k in NUMERIC_SETTINGS if k != first)]))
        value = draw(BAD_VALUES[kind])
        if kind == "huge" and key in FRACTIONS:
            value = draw(st.sampled_from([1.0000001, 2, 1e300]))  # a fraction above 1
        config[key] = value
    if kind not in ("pic_not_object", "pic_unknown_field"):
        pic = {**pic, "config": config}
    body["pic"] = pic
    return Case(f"bad_config_{kind}_{surface}", r.path, _json(body), "bad", r.stream)


FLAG_KINDS = ("message", "item", "empty_chunk")


@st.composite
def bad_pic_chunk_flags(draw: DrawFn, kind: str) -> Case:
    """``pic_chunk`` must be a boolean, on a message or on a content item; an empty chunk
    is refused too."""
    r = draw(surface_requests("chat_chunked"))
    value = draw(st.sampled_from(["yes", "true", 1, 0, [], {}, "false"]))
    doc = draw(st.sampled_from(POOL))
    if kind == "empty_chunk":
        first: dict[str, Any] = {"role": "user", "content": "", "pic_chunk": True}
    elif kind == "message":
        first = {"role": "user", "content": doc, "pic_chunk": value}
    else:
        first = {"role": "user", "content": [{"type": "text", "text": doc, "pic_chunk": value}]}
    r.body["messages"] = [first, *r.body["messages"]]
    return Case(f"bad_pic_chunk_{kind}", r.path, _json(r.body), "bad", r.stream)


@st.composite
def out_of_vocab_ids(draw: DrawFn, surface: str) -> Case:
    """A token id outside [0, vocab), plain or chunked, single or batch."""
    r = draw(surface_requests(surface))
    bad = draw(st.sampled_from([VOCAB, VOCAB + 1, 2**31, 2**40, -1, -(2**31)]))
    key = "prompt" if r.path == COMPLETIONS else "input_ids"
    seqs = r.body[key] if isinstance(r.body[key][0], list) else [r.body[key]]
    seq = seqs[draw(st.integers(0, len(seqs) - 1))]
    seq[draw(st.integers(0, len(seq) - 1))] = bad
    return Case(f"bad_ids_{surface}", r.path, _json(r.body), "bad", r.stream)


INTERNAL_KINDS = ("custom_params", "extra_key")


@st.composite
def internal_keys(draw: DrawFn, kind: str, surface: str, stream: bool | None = None) -> Case:
    """Client-supplied internal keys: ``sgl_pic_*`` in custom_params (sampling_params' on
    /generate, top-level on the OpenAI paths), or an ``extra_key`` in sgl_pic's namespace."""
    r = draw(surface_requests(surface, stream))
    body = r.body
    if kind == "custom_params":
        toks = body.get("input_ids")
        n = len(toks) if isinstance(toks, list) and toks and isinstance(toks[0], int) else 16
        # Forged marks that would be well formed for this request: the real attack.
        key, value = draw(
            st.sampled_from(
                [
                    ("sgl_pic_chunks", [0, min(n, 8)]),
                    ("sgl_pic_num_tokens", n),
                    ("sgl_pic_config", {"policy": "full_reuse"}),
                    ("sgl_pic_mac", "0" * 64),
                    ("sgl_pic_anything", 1),
                ]
            )
        )
        holder = body.setdefault("sampling_params", {}) if r.path == GENERATE else body
        holder["custom_params"] = {**holder.get("custom_params", {}), key: value}
    else:
        value = "sgl_pic" + draw(st.sampled_from(["", ":", ":x", "_ns", ":exact"]))
        batch = surface in BATCH_SURFACES
        body["extra_key"] = ["ok", value] if batch and draw(st.booleans()) else value
    return Case(f"bad_internal_{kind}_{surface}", r.path, _json(body), "bad", r.stream)


@st.composite
def deep_json(draw: DrawFn, path: str, whole: bool) -> Case:
    """Nesting 10_000 deep, as the whole body or inside a field."""
    depth = 10_000
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    inner = opener * depth + "1" + closer * depth
    field = {GENERATE: "text", COMPLETIONS: "prompt", CHAT: "messages"}[path]
    raw = inner if whole else f'{{"model": "default", "{field}": {inner}}}'
    return Case("bad_deep_json", path, raw.encode(), "bad")


@st.composite
def oversized(draw: DrawFn, path: str, chunked_transfer: bool) -> Case:
    """A body over --pic-max-body-mb, with Content-Length or without (chunked)."""
    limit = MAX_BODY_MB << 20
    extra = draw(st.integers(1, 1000))
    body: dict[str, Any]
    if path == CHAT:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "x " * (limit // 2 + extra)}],
        }
    else:
        # Token ids ("1, " = 3 bytes each): if the limit did not hold, SGLang would refuse
        # the prompt as too long rather than spend minutes on it.
        key = "input_ids" if path == GENERATE else "prompt"
        body = {key: [1] * (limit // 3 + extra)}
        if path == COMPLETIONS:
            body["model"] = "default"
    data = _json(body)
    assert len(data) > limit
    return Case("too_large", path, data, "too_large", chunked_transfer=chunked_transfer)


@st.composite
def invalid_json(draw: DrawFn, path: str) -> Case:
    raw = draw(st.sampled_from([b'{"text": "a", ', b"not json", b'{"text": "a"} x', b"\xff\xfe"]))
    return Case("bad_invalid_json", path, raw, "bad")


# --------------------------------------------------------------------------- the tests

INTERNAL_CATALOG = (  # (surface, stream for custom_params)
    ("generate_ids", False),
    ("generate_chunked_ids", True),
    ("generate_batch_text", False),
    ("generate_chunked_text", False),
    ("completions_text", True),
    ("completions_batch_ids", False),
    ("chat_plain", True),
    ("chat_chunked", False),
)
# Every form and every variant the contract names, once: id -> strategy.
CATALOG: dict[str, st.SearchStrategy[Case]] = {
    **{f"valid-{s}": valid(s) for s in SURFACES},
    "exact_probe": exact_probe(),
    "poison": poison(),
    **{f"edge-{k}": valid_edges(k) for k in EDGE_KINDS},
    **{f"spans-{k}": bad_spans(k) for k in SPAN_KINDS},
    **{f"text-{k}": bad_text_marks(k) for k in TEXT_KINDS},
    **{f"batch-{k}": bad_batches(k) for k in BATCH_KINDS},
    # Every bad-config kind once, the chunked surfaces taken in turn.
    **{
        f"config-{k}-{CHUNKED_SURFACES[i % 3]}": bad_configs(k, CHUNKED_SURFACES[i % 3])
        for i, k in enumerate(CONFIG_KINDS)
    },
    **{f"pic_chunk-{k}": bad_pic_chunk_flags(k) for k in FLAG_KINDS},
    **{f"ids-{s}": out_of_vocab_ids(s) for s in ID_SURFACES},
    # Both kinds of internal key on every path, single and batch, plain and chunked,
    # streaming and not (each kind streams where the other does not).
    **{
        f"internal-{k}-{s}-{'stream' if stream else 'plain'}": internal_keys(k, s, stream)
        for k in INTERNAL_KINDS
        for s, first in INTERNAL_CATALOG
        for stream in [first != (k == "extra_key") and s in STREAM_SURFACES]
    },
    **{
        f"deep-{PATH_NAMES[p]}-{'whole' if w else 'field'}": deep_json(p, w)
        for p in PATHS
        for w in (True, False)
    },
    **{
        f"too_large-{PATH_NAMES[p]}-{'chunked' if c else 'length'}": oversized(p, c)
        for p in PATHS
        for c in (False, True)
    },
    **{f"invalid_json-{PATH_NAMES[p]}": invalid_json(p) for p in PATHS},
}

# The random sequence: families with their variants drawn; valid requests most often,
# as they build the cache state the canary and the probe are checked against.
FAMILIES: dict[str, st.SearchStrategy[Case]] = {
    "valid": st.sampled_from(SURFACES).flatmap(valid),
    "exact_probe": exact_probe(),
    "poison": poison(),
    # Not max_chunks: its 256 phase-1 sub-requests are the slowest valid form there is.
    "edge": st.sampled_from(EDGE_KINDS[1:]).flatmap(valid_edges),
    "spans": st.sampled_from(SPAN_KINDS).flatmap(bad_spans),
    "text": st.sampled_from(TEXT_KINDS).flatmap(bad_text_marks),
    "batch": st.sampled_from(BATCH_KINDS).flatmap(bad_batches),
    "config": st.tuples(st.sampled_from(CONFIG_KINDS), st.sampled_from(CHUNKED_SURFACES)).flatmap(
        lambda ks: bad_configs(*ks)
    ),
    "pic_chunk": st.sampled_from(FLAG_KINDS).flatmap(bad_pic_chunk_flags),
    "ids": st.sampled_from(ID_SURFACES).flatmap(out_of_vocab_ids),
    "internal": st.tuples(st.sampled_from(INTERNAL_KINDS), st.sampled_from(SURFACES)).flatmap(
        lambda ks: internal_keys(*ks)
    ),
    "deep": st.tuples(st.sampled_from(PATHS), st.booleans()).flatmap(lambda a: deep_json(*a)),
    "too_large": st.tuples(st.sampled_from(PATHS), st.booleans()).flatmap(lambda a: oversized(*a)),
    "invalid_json": st.sampled_from(PATHS).flatmap(invalid_json),
}
WEIGHTED = ("valid",) * 10 + ("poison",) * 2 + ("exact_probe",) * 2 + tuple(FAMILIES)

COMMON: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,  # the same sequence on every run (CI reproducible)
    "database": None,
    # No shrinking: server state carries over, so a shrunk request alone proves nothing
    # (the failure message lists the forms sent before it instead).
    "phases": (Phase.explicit, Phase.generate),
    "suppress_health_check": (
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ),
}


@pytest.mark.parametrize("form", list(CATALOG))
@settings(max_examples=1, **COMMON)
@given(data=st.data())
def test_each_form_once(fuzzer: Fuzzer, form: str, data: st.DataObject) -> None:
    fuzzer.run(data.draw(CATALOG[form], label=form))


@settings(max_examples=EXAMPLES, **COMMON)
@given(data=st.data())
def test_random_request_sequence(fuzzer: Fuzzer, data: st.DataObject) -> None:
    family = data.draw(st.sampled_from(WEIGHTED), label="family")
    fuzzer.run(data.draw(FAMILIES[family], label=family))
