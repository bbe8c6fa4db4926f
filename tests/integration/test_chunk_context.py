"""Chunks encoded after the prompt's first chunk (``--pic-chunk-context first_chunk``)
through the server: what a request is served is the oracle's full reuse of exactly that
KV, whether phase 1 computed the context with the chunk or read it from the device
prefix, and a chunk is found again only behind the same first chunk."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.prompts import DOCS, body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

HITS = ('sgl_pic_chunk_hits_total{kind="contiguous"}', 'sgl_pic_chunk_hits_total{kind="disjoint"}')
MISSES = "sgl_pic_chunk_misses_total"
ENCODED = "sgl_pic_encoded_tokens_total"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--pic-chunk-context", "first_chunk") as s:
        yield s


def context_reference(toks: list[int], spans: list[list[int]]) -> torch.Tensor:
    """The oracle's next-token log-probabilities (# [vocab] float64) for full reuse of
    the first chunk's independent KV and every later chunk's KV encoded after it
    (``check.served_chunks``, checked against the oracle's encoding in test_check)."""
    from sgl_pic.cli.check import served_chunks
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.model.embedded import ensure_embedded_model
    from sgl_pic.oracle import Oracle
    from sgl_pic.selection import make_policy

    oracle = Oracle.from_pretrained(ensure_embedded_model().path)
    t = torch.tensor(toks)
    layout = PromptLayout.from_spans(len(toks), spans)
    alone = [oracle.encode_chunk(t[s:e]) for s, e in spans]
    chunks = served_chunks(oracle, t, layout, PicConfig(chunk_context="first_chunk"), alone)
    policy = make_policy(PicConfig(policy="full_reuse"))
    return torch.log_softmax(oracle.reuse(t, layout, chunks, policy).logits.double(), -1)


def served_matches(server: Server, toks: list[int], spans: list[list[int]]) -> dict:
    """Sends the prompt under full reuse; asserts its first token's top log-probabilities
    are the oracle's (``context_reference``) and returns the metric deltas."""
    req = body(toks, spans, n=1, policy="full_reuse")
    req.update(return_logprob=True, top_logprobs_num=8)
    out, d = server.send(req)
    assert d["sgl_pic_failures_total"] == 0
    ref = context_reference(toks, spans)
    for logprob, token_id, _ in out["meta_info"]["output_top_logprobs"][0]:
        assert abs(logprob - float(ref[token_id])) < 1e-3, (token_id, logprob, float(ref[token_id]))
    return {**d, "cached_tokens": out["meta_info"]["cached_tokens"]}


def test_chunks_encoded_after_the_first_are_served_and_found_behind_it_only(
    server: Server,
) -> None:
    # All misses: phase 1 computes the context (E) with A and with B.
    toks, spans = chunked(["E", "A", "B"], "Which city has temples?")
    d = served_matches(server, toks, spans)
    e_len = spans[0][1]
    assert d[MISSES] == 3
    assert d[ENCODED] == sum(e - s for s, e in spans) + 2 * e_len
    # The comparison tells chunks encoded after E from chunks encoded alone.
    from tests.support.oracle_refs import full_reuse_reference

    alone, _ = full_reuse_reference(toks, spans)
    assert (alone - context_reference(toks, spans)).abs().max() > 1e-2
    # E is now device prefix; B and A are found encoded after it, in another order.
    toks, spans = chunked(["E", "B", "A"], "Which river meets the Rhone?")
    d = served_matches(server, toks, spans)
    assert d["cached_tokens"] >= e_len
    assert (sum(d[h] for h in HITS), d[MISSES], d[ENCODED]) == (2, 0, 0)
    # C is new: encoded after E read from the request's device prefix, not computed.
    toks, spans = chunked(["E", "C", "A"], "Which city is on the equator?")
    d = served_matches(server, toks, spans)
    assert (sum(d[h] for h in HITS), d[MISSES]) == (1, 1)
    assert d[ENCODED] == spans[1][1] - spans[1][0]
    # Behind another first chunk, A and C are other KV: missed and encoded again.
    toks, spans = chunked(["D", "A", "C"], "Where is the midnight sun?")
    d = served_matches(server, toks, spans)
    assert d[MISSES] == 3


def test_a_first_chunk_after_fresh_text_is_computed_with_each_miss(server: Server) -> None:
    # The first chunk does not start the prompt: its KV in any device prefix is reuse's
    # approximation, so phase 1 computes the header and the first chunk with each miss.
    toks, spans = chunked(["B", "D"], "Where is Kyoto?", header="Walrus memo.\n")
    req = body(toks, spans, n=1, policy="full_reuse")
    _, d = server.send(req)
    assert d[MISSES] == 2 and d["sgl_pic_failures_total"] == 0
    assert d[ENCODED] == sum(e - s for s, e in spans) + spans[0][1]
    toks, spans = chunked(["B", "C"], "Where is Quito?", header="Walrus memo.\n")
    _, d = server.send(body(toks, spans, n=1, policy="full_reuse"))
    assert d[MISSES] == 1 and d[ENCODED] == spans[0][1] + spans[1][1] - spans[1][0]


def test_deleting_a_first_chunk_deletes_the_chunks_encoded_after_it(server: Server) -> None:
    """Their K/V carry what attention took from it: a deletion of its content (as text,
    every namespace) takes them from every tier with it; chunks encoded after another
    first chunk stay."""
    import requests

    for names in (["A", "B", "C"], ["D", "B", "C"]):
        server.send(body(*chunked(names, "Which city?"), n=1))
    _, d = server.send(body(*chunked(["A", "C", "B"], "Which port?"), n=1))
    assert (sum(d[h] for h in HITS), d[MISSES]) == (2, 0)
    # Host and disk keep their copies: the device's alone would not show every tier.
    r = requests.post(server.url + "/pic/delete", json={"text": DOCS["A"] + "\n"}, timeout=300)
    assert r.status_code == 200, r.text
    tiers = r.json()["deleted"]["tiers"]
    # A itself, B and C encoded after it (and A encoded after other first chunks, by the
    # tests before), in each of the device and host tiers.
    assert tiers["device"]["records"] >= 3 and tiers["host"]["records"] >= 3
    _, d = server.send(body(*chunked(["A", "B", "C"], "Which river?"), n=1))
    assert d[MISSES] == 3
    # D too is a hit now: a deletion moves chunked requests to fresh prefix namespaces.
    _, d = server.send(body(*chunked(["D", "C", "B"], "Which sun?"), n=1))
    assert (sum(d[h] for h in HITS), d[MISSES]) == (3, 0)


def test_a_request_cut_into_prefill_pieces_is_served_the_same_kv() -> None:
    """Planned whole at its first piece (a scratch row standing for the prompt), a split
    request encodes its misses after the first chunk as an unsplit one does: computed
    with the chunk, or read from the device prefix."""
    with launch("--pic-chunk-context", "first_chunk", "--chunked-prefill-size", "24") as split:
        toks, spans = chunked(["E", "A", "B"], "Which city has temples?")
        d = served_matches(split, toks, spans)
        assert d["sgl_pic_split_requests_total"] == 1 and d[MISSES] == 3
        toks, spans = chunked(["E", "B", "C"], "Which city is on the equator?")
        d = served_matches(split, toks, spans)
        assert d["sgl_pic_split_requests_total"] == 1 and d["cached_tokens"] >= spans[0][1]
        assert (sum(d[h] for h in HITS), d[MISSES]) == (1, 1)
        assert d[ENCODED] == spans[2][1] - spans[2][0]
