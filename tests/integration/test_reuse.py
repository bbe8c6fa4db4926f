"""Chunk reuse through the server (the default policy): hits in any order, DARIC's
[B, A, D, C] example, last-token logits against the oracle, and bad input over HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.support.prompts import body, chunked, ids
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

CONTIG = 'sgl_pic_chunk_hits_total{kind="contiguous"}'
DISJOINT = 'sgl_pic_chunk_hits_total{kind="disjoint"}'
MISSES = "sgl_pic_chunk_misses_total"
ENCODED = "sgl_pic_encoded_tokens_total"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch() as s:
        yield s


def test_chunks_cached_in_another_order_all_hit(server: Server) -> None:
    toks, spans = chunked(["A", "B", "C"], "Which city is on the equator?")
    _, d = server.send(body(toks, spans))
    assert d[MISSES] == 3
    assert d[ENCODED] == sum(e - s for s, e in spans)  # phase 1 ran every chunk token
    out, d = server.send(body(*chunked(["C", "B", "A"], "Which city had temples?")))
    assert out["meta_info"]["cached_tokens"] == 0  # no device prefix: hits are the store's
    assert d[CONTIG] + d[DISJOINT] == 3
    assert d[MISSES] == 0 and d[ENCODED] == 0
    assert d["sgl_pic_reused_tokens_total"] > 0
    assert d["sgl_pic_failures_total"] == 0


def test_plain_request_never_reads_chunked_kv(server: Server) -> None:
    # Not D: the next test needs D never seen before.
    toks, spans = chunked(["C", "E"], "Which city is on the equator?")
    assert server.generate(body(toks, spans)).status_code == 200
    again = server.generate(body(toks, spans))
    assert again.json()["meta_info"]["cached_tokens"] > 0  # chunked requests share prefixes
    plain = server.generate(body(toks, None))
    assert plain.status_code == 200, plain.text
    # Same tokens, but the chunked request's (approximate) KV is in another namespace.
    assert plain.json()["meta_info"]["cached_tokens"] == 0


def test_daric_example_reuses_chunk_after_a_miss(server: Server) -> None:
    server.send(body(*chunked(["A", "B", "C"], "Which city is on the equator?")))
    _, d = server.send(body(*chunked(["B", "A", "D", "C"], "Where is the midnight sun?")))
    assert (d[CONTIG], d[MISSES], d[DISJOINT]) == (2, 1, 1)


def test_last_token_logits_match_oracle(server: Server) -> None:
    from tests.support.oracle_refs import full_reuse_reference

    # A header no other prompt starts with, so nothing of it is device prefix.
    toks, spans = chunked(["E", "C", "B"], "Which port has funiculars?", header="Zebra note.\n")
    req = body(toks, spans, n=1, policy="full_reuse")
    req.update(return_logprob=True, top_logprobs_num=8)
    out, d = server.send(req)
    assert out["meta_info"]["cached_tokens"] == 0
    assert d["sgl_pic_failures_total"] == 0
    top = out["meta_info"]["output_top_logprobs"][0]  # [[logprob, token_id, text], ...]

    ref, full = full_reuse_reference(toks, spans)
    for logprob, token_id, _ in top:
        assert abs(logprob - float(ref[token_id])) < 1e-3, (token_id, logprob, float(ref[token_id]))
    # The comparison can tell reuse from full prefill apart on this prompt.
    assert max(abs(float(full[tid]) - float(ref[tid])) for _, tid, _ in top) > 1e-3


def _cut_request(h: list[int], chunk: list[int], question: list[int]) -> tuple:
    toks = h + chunk + question
    spans = [[len(h), len(h) + len(chunk)]]
    req = body(toks, spans, n=1, policy="full_reuse")
    req.update(return_logprob=True, top_logprobs_num=8)
    return toks, spans, req


def _check_cut_chunk_against_oracle(
    out: dict[str, Any], toks: list[int], spans: list[list[int]], head: list[int], prefix: int
) -> None:
    """The KV a request whose device prefix cut its one chunk ran on: ``head`` exact (fresh
    in the request that left it), the chunk's first rows as that request had them (the same
    tokens' chunk KV), the rest the chunk's independent KV; its first token's top
    logprobs are the oracle's for exactly that KV."""
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.model.embedded import ensure_embedded_model
    from sgl_pic.oracle import Oracle
    from sgl_pic.selection import finalize, make_policy
    from sgl_pic.selection.base import SelectionContext

    oracle = Oracle.from_pretrained(ensure_embedded_model().path)
    t = torch.tensor(toks)
    layout = PromptLayout.from_spans(len(toks), spans)
    chunks = [oracle.encode_chunk(t[s:e]) for s, e in spans]
    kv = oracle.assemble(t, layout, chunks)
    exact = oracle.prefill(t[: len(head)]).kv
    kv.k[:, : len(head)] = exact.k
    kv.v[:, : len(head)] = exact.v
    policy = make_policy(PicConfig(policy="full_reuse"))
    ctx = SelectionContext(layout, tuple(c.ranking for c in chunks), lambda: None, prefix)
    ref = torch.log_softmax(
        oracle.recompute(t, kv, finalize(policy.select(ctx), layout, prefix)).logits.double(), -1
    )
    top = out["meta_info"]["output_top_logprobs"][0]  # [[logprob, token_id, text], ...]
    for logprob, token_id, _ in top:
        assert abs(logprob - float(ref[token_id])) < 1e-3, (token_id, logprob, float(ref[token_id]))


def test_a_chunk_the_radix_prefix_cuts_reuses_its_device_copy(server: Server) -> None:
    """Two chunks open with the same label. After a request with the first, SGLang's radix
    prefix of a request with the second ends inside it, after the label; the second was
    cached earlier, so its rest comes from its chunk node (a contiguous device hit)
    instead of being recomputed, and the answer is the oracle's for exactly that KV."""
    from tests.support.prompts import DOCS

    label = ids("Archive card 93 reads:")
    first, second = label + ids(" " + DOCS["C"] + "\n"), label + ids(" " + DOCS["E"] + "\n")
    head = ids("Walrus ledger.\n")
    question = ids("Question: Which city is a port?\nAnswer:")

    r = server.generate(_cut_request(ids("Heron ledger.\n"), second, question)[2])  # caches it
    assert r.status_code == 200, r.text
    r = server.generate(_cut_request(head, first, question)[2])  # leaves head + label as prefix
    assert r.status_code == 200, r.text
    toks, spans, req = _cut_request(head, second, question)
    out, d = server.send(req)
    prefix = len(head) + len(label)
    assert out["meta_info"]["cached_tokens"] == prefix
    assert (d[CONTIG], d[DISJOINT], d[MISSES], d[ENCODED]) == (1, 0, 0, 0)
    assert d["sgl_pic_recomputed_tokens_total"] == len(question)  # fresh text only
    assert d["sgl_pic_reused_tokens_total"] == len(second) - len(label)
    _check_cut_chunk_against_oracle(out, toks, spans, head, prefix)


def test_a_chunk_the_radix_prefix_cuts_seen_first_is_encoded_whole_and_stored(
    server: Server,
) -> None:
    """As above, but the cut chunk was never cached: phase 1 encodes it whole on slots of
    its own (the prefix's are shared), stores it, and the request reuses its rows past the
    prefix; the answer is the oracle's for that KV, and a later request finds the chunk."""
    from tests.support.prompts import DOCS

    label = ids("Registry slip 41 says:")
    first, second = label + ids(" " + DOCS["A"] + "\n"), label + ids(" " + DOCS["D"] + "\n")
    head = ids("Gannet ledger.\n")
    question = ids("Question: Where is the sun at midnight?\nAnswer:")

    r = server.generate(_cut_request(head, first, question)[2])  # leaves head + label as prefix
    assert r.status_code == 200, r.text
    toks, spans, req = _cut_request(head, second, question)
    out, d = server.send(req)
    prefix = len(head) + len(label)
    assert out["meta_info"]["cached_tokens"] == prefix
    assert (d[CONTIG], d[DISJOINT], d[MISSES]) == (0, 0, 1)
    assert d[ENCODED] == len(second)  # whole, the label included
    assert d["sgl_pic_recomputed_tokens_total"] == len(question)  # fresh text only
    _check_cut_chunk_against_oracle(out, toks, spans, head, prefix)
    # Stored when first seen: elsewhere, it is a hit.
    _, d = server.send(_cut_request(ids("Tern ledger.\n"), second, question)[2])
    assert d[CONTIG] == 1 and d[MISSES] == 0 and d[ENCODED] == 0


def _server_against_oracle(server: Server, toks: list[int], spans: list, **pic: object) -> Any:
    """Sends the chunked request with ``pic`` overrides, checks its selection size and
    top-8 first-token logprobs against the oracle's (a different set of the same size
    would show in the logprobs); returns (oracle, ids, layout, chunks, reference logprobs,
    the server's top logprobs)."""
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.model.embedded import ensure_embedded_model
    from sgl_pic.oracle import Oracle
    from sgl_pic.selection import make_policy

    req = body(toks, spans, n=1, **pic)
    req.update(return_logprob=True, top_logprobs_num=8)
    out, d = server.send(req)
    assert out["meta_info"]["cached_tokens"] == 0
    assert d["sgl_pic_failures_total"] == 0

    oracle = Oracle.from_pretrained(ensure_embedded_model().path)
    t = torch.tensor(toks)
    layout = PromptLayout.from_spans(len(toks), spans)
    chunks = [oracle.encode_chunk(t[s:e]) for s, e in spans]
    res = oracle.reuse(t, layout, chunks, make_policy(PicConfig().with_overrides(**pic)))
    assert d["sgl_pic_recomputed_tokens_total"] == res.computed.indices.numel()
    ref = torch.log_softmax(res.logits.double(), -1)
    top = out["meta_info"]["output_top_logprobs"][0]  # [[logprob, token_id, text], ...]
    for logprob, token_id, _ in top:
        assert abs(logprob - float(ref[token_id])) < 1e-3, (token_id, logprob, float(ref[token_id]))
    return oracle, t, layout, chunks, ref, top


def test_cacheblend_online_deviation_matches_oracle(server: Server) -> None:
    toks, spans = chunked(["D", "E", "A"], "Which city has a port?", header="Yak memo.\n")
    _server_against_oracle(server, toks, spans, policy="cacheblend", cacheblend_ratio=0.3)


def test_query_aware_probe_matches_oracle(server: Server) -> None:
    from sgl_pic.config import PicConfig
    from sgl_pic.selection import make_policy

    pic = {"policy": "query_aware", "qa_ratio": 0.2, "qa_sink_tokens": 2, "qa_layers": 3}
    toks, spans = chunked(["B", "D", "E"], "Which city has a port?", header="Gnu memo.\n")
    oracle, t, layout, chunks, ref, top = _server_against_oracle(server, toks, spans, **pic)
    # The probe's choice matters here: the oracle's sinks-only selection of the same size
    # (no attention ranking) gives other logprobs.
    sinks_only = make_policy(PicConfig(**{**pic, "qa_sink_tokens": 10_000}))
    other = torch.log_softmax(oracle.reuse(t, layout, chunks, sinks_only).logits.double(), -1)
    assert max(abs(float(other[tid]) - float(ref[tid])) for _, tid, _ in top) > 1e-3


def test_phase_forwards_are_counted_with_their_tokens(server: Server) -> None:
    """Each forward the chunk path runs is counted by phase with its tokens: phase 1 has
    exactly the missed chunks' tokens, phase 2 the recomputed ones, and the probe only
    tokens phase 2 computes too."""
    phases = ("phase1", "probe", "deviation", "phase2")
    fwd = {p: f'sgl_pic_phase_forwards_total{{phase="{p}"}}' for p in phases}
    tok = {p: f'sgl_pic_phase_forward_tokens_total{{phase="{p}"}}' for p in phases}
    keys = {p: f'sgl_pic_phase_attended_keys_total{{phase="{p}"}}' for p in phases}
    # Chunk text no other test sends: every chunk misses, whatever ran before.
    docs = [f"Ibex ledger {i}: the ferry from Oskarn leaves at {7 + i} each day.\n" for i in (1, 2)]
    toks, spans = ids("Ibex memo.\n"), []
    for doc in docs:
        spans.append([len(toks), len(toks) + len(ids(doc))])
        toks += ids(doc)
    toks += ids("Question: When does the ferry leave?\nAnswer:")
    before = server.metrics()
    r = server.generate(body(toks, spans, n=1, policy="query_aware"))
    assert r.status_code == 200, r.text
    after = server.metrics()
    counted = [*fwd.values(), *tok.values(), *keys.values()]
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in counted}
    encoded = after[ENCODED] - before.get(ENCODED, 0.0)
    recomputed = "sgl_pic_recomputed_tokens_total"
    assert encoded == sum(e - s for s, e in spans)
    assert (d[fwd["phase1"]], d[fwd["probe"]], d[fwd["deviation"]], d[fwd["phase2"]]) == (
        1,
        1,
        0,
        1,
    )
    assert d[tok["phase1"]] == encoded
    assert d[tok["phase2"]] == after[recomputed] - before.get(recomputed, 0.0)
    assert 0 < d[tok["probe"]] <= d[tok["phase2"]]
    # Phase 1 encodes each chunk on its own from position 0. Phase 2's queries are
    # distinct positions of the prompt, the last token (which sees every key) among them.
    assert d[keys["phase1"]] == sum((e - s) * (e - s + 1) // 2 for s, e in spans)
    t2, n = int(d[tok["phase2"]]), len(toks)
    assert t2 * (t2 + 1) // 2 <= d[keys["phase2"]] <= t2 * n
    assert d[keys["phase2"]] >= n
    assert d[keys["deviation"]] == 0


def _batches_of_three(server: Server) -> int:
    """Batches the server has logged with three chunked requests."""
    text = Path(server.log_path).read_text(errors="replace")
    return text.count("sgl_pic batch: 3 chunked request(s)")


def _one_batch(server: Server, reqs: list[dict], attempt: int) -> list[requests.Response]:
    """Sends ``reqs`` at once while a long plain prefill holds the scheduler, so that they
    queue together and, normally, run as one batch (the caller checks that they did)."""
    import concurrent.futures as cf

    from tests.support.prompts import DOCS

    filler = " ".join(DOCS.values()) + "\n"
    blocker = body(ids(f"Blocker {attempt}.\n" + filler * 24), None, n=1)
    with cf.ThreadPoolExecutor(len(reqs) + 1) as pool:
        first = pool.submit(server.generate, blocker)
        # The blocker's prefill must have started; it runs for seconds. SGLang shows no
        # sign of a prefill until it ends (its log line and gauges come after), so each
        # attempt waits longer, for a runner too loaded to start it in time.
        time.sleep(0.5 * 2**attempt)
        futures = [pool.submit(server.generate, req) for req in reqs]
        assert first.result().status_code == 200
        return [f.result() for f in futures]


def test_requests_of_one_batch_share_a_probe_pass_and_each_matches_oracle(
    server: Server,
) -> None:
    """Three chunked query-aware requests, two with qa_layers 3 and one with 2, run as one
    batch: two probe passes, and each request still gets the oracle's selection and
    first-token logprobs (its rows of a shared pass are its own)."""
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.model.embedded import ensure_embedded_model
    from sgl_pic.oracle import Oracle
    from sgl_pic.selection import make_policy

    oracle = Oracle.from_pretrained(ensure_embedded_model().path)
    cases = [
        (["C", "E", "B"], "Which port has temples?", 3),
        (["A", "D"], "Where do rivers meet?", 3),
        (["E", "A", "C"], "Which city is cold?", 2),
    ]
    recomputed = "sgl_pic_recomputed_tokens_total"
    # Batching is the scheduler's choice: the blocker makes it all but certain, and a
    # few attempts (fresh headers, so no device prefix) make a timing hiccup harmless.
    for attempt in range(3):
        reqs, want = [], 0
        for i, (names, question, layers) in enumerate(cases):
            header = f"Probe batch {attempt}.{i}.\n"
            toks, spans = chunked(names, question, header=header)
            pic = {"policy": "query_aware", "qa_ratio": 0.2, "qa_sink_tokens": 2}
            pic["qa_layers"] = layers
            req = body(toks, spans, n=1, **pic)
            req.update(return_logprob=True, top_logprobs_num=8)
            t = torch.tensor(toks)
            layout = PromptLayout.from_spans(len(toks), spans)
            chunks = [oracle.encode_chunk(t[s:e]) for s, e in spans]
            res = oracle.reuse(t, layout, chunks, make_policy(PicConfig().with_overrides(**pic)))
            want += res.computed.indices.numel()
            reqs.append((req, torch.log_softmax(res.logits.double(), -1)))
        before, seen = server.metrics(), _batches_of_three(server)
        outs = _one_batch(server, [req for req, _ in reqs], attempt)
        after = server.metrics()
        assert all(o.status_code == 200 for o in outs), [o.text for o in outs]
        assert after["sgl_pic_failures_total"] == before["sgl_pic_failures_total"]
        for (_, ref), out in zip(reqs, outs, strict=True):
            top = out.json()["meta_info"]["output_top_logprobs"][0]  # [[logprob, id, _]]
            for logprob, token_id, _ in top:
                assert abs(logprob - float(ref[token_id])) < 1e-3, (token_id, logprob)
        passes = after["sgl_pic_probe_passes_total"] - before.get("sgl_pic_probe_passes_total", 0)
        assert 2 <= passes <= 3
        # Two passes alone could be the qa_layers-3 pair batched and the third on its own.
        if passes == 2 and _batches_of_three(server) > seen:
            # Only in one batch does no request find another's header ("Probe batch
            # {attempt}.") in the radix tree, which the oracle does not have either.
            assert after[recomputed] - before[recomputed] == want
            return
    pytest.fail("the three requests never ran as one batch:\n" + server.log_tail())


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        ({"input_ids": [1, 2, 3], "pic": {"chunks": [[0, 2], [1, 3]]}}, "overlaps"),
        ({"input_ids": [1, 2, 3], "pic": {"chunks": [[0, 9]]}}, "out of range"),
        ({"input_ids": [1, 2, 3], "pic": {"chunks": [[2, 2]]}}, "empty"),
        ({"input_ids": [1, 2, 3], "pic": {"chunks": [[0]]}}, "pair"),
        ({"text": "a <|pic_chunk|> b"}, "unbalanced"),
        ({"text": "a <|pic_chunk|><|pic_chunk|> b"}, "empty"),
        ({"text": "a", "pic": {"config": {"policy": "nope"}}}, "unknown policy"),
        ({"text": "a", "pic": {"config": {"page_size": 4}}}, "cannot be overridden"),
        ({"text": ["a", "b"], "pic": {}}, "one 'text' string"),
    ],
)
def test_bad_marks_get_400_and_server_keeps_serving(server: Server, req: dict, needle: str) -> None:
    r = server.generate(req)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = server.generate(body(*chunked(["D"], "Where is Tromso?"), n=2))
    assert ok.status_code == 200, ok.text


def _chat_body(question: str = "Where is the midnight sun seen?", **extra: Any) -> dict[str, Any]:
    from tests.support.prompts import DOCS

    return {
        "model": "default",
        "messages": [
            {"role": "user", "content": DOCS["A"], "pic_chunk": True},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": DOCS["D"], "pic_chunk": True},
                    {"type": "text", "text": question},
                ],
            },
        ],
        "temperature": 0,
        "max_tokens": 6,
        **extra,
    }


def test_openai_chat_marks_reach_the_chunk_cache(server: Server) -> None:
    from sgl_pic.core.drift_signal import META_KEY

    before = server.metrics()
    r = requests.post(server.url + "/v1/chat/completions", json=_chat_body(), timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"]
    after = server.metrics()
    assert after["sgl_pic_requests_total"] == before["sgl_pic_requests_total"] + 1
    assert after["sgl_pic_chunk_lookups_total"] == before["sgl_pic_chunk_lookups_total"] + 2
    # Served by reuse: the drift signal is in the response's metadata, beside SGLang's own.
    (entropy,) = out["metadata"][META_KEY]
    assert 0.0 <= entropy < 20.0 and "weight_version" in out["metadata"], out["metadata"]
    # Another question after the same chunks: the value SGLang's own return_meta_info shows.
    r = requests.post(
        server.url + "/v1/chat/completions",
        json=_chat_body("Which river is it near?", return_meta_info=True),
        timeout=300,
    )
    assert r.status_code == 200, r.text
    again = r.json()
    column = again["choices"][0]["meta_info"][META_KEY]  # per output token, None after
    assert again["metadata"][META_KEY] == [next(v for v in column if v is not None)]
    # A chat request without marks is not served by reuse: SGLang's metadata only.
    plain = _chat_body()
    plain["messages"] = [{"role": "user", "content": "Where is the midnight sun seen?"}]
    r = requests.post(server.url + "/v1/chat/completions", json=plain, timeout=300)
    assert r.status_code == 200, r.text
    assert META_KEY not in r.json()["metadata"], r.json()
    # Streamed chunks have no metadata field: the stream is SGLang's.
    r = requests.post(
        server.url + "/v1/chat/completions", json=_chat_body(stream=True), timeout=300
    )
    assert r.status_code == 200, r.text
    events = [line for line in r.text.splitlines() if line.startswith("data: {")]
    assert events and all(META_KEY not in line for line in events)


def test_frontend_chunk_primitive(server: Server) -> None:
    import sglang as sgl

    from sgl_pic.frontend import chunk
    from tests.support.prompts import DOCS

    @sgl.function
    def qa(s, docs: list[str], question: str) -> None:  # type: ignore[no-untyped-def]
        for d in docs:
            s += chunk(d + "\n")
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=6)

    before = server.metrics()
    state = qa.run(
        docs=[DOCS["B"], DOCS["E"]],
        question="Which city has temples?",
        temperature=0,
        backend=sgl.RuntimeEndpoint(server.url),
    )
    assert state["answer"]
    after = server.metrics()
    assert after["sgl_pic_requests_total"] == before["sgl_pic_requests_total"] + 1
    # Both docs were cached as chunks by earlier tests of this module: none is computed
    # again (B opens [B, A, D, C] above, so it may come from the device prefix instead).
    keys = (CONTIG, DISJOINT, "sgl_pic_chunk_device_prefix_total")
    assert sum(after[k] - before.get(k, 0.0) for k in keys) == 2
    assert after[MISSES] == before[MISSES]
