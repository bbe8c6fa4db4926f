"""Store admission through the server: with ``--pic-admission second_sight`` a missed
chunk is computed in context on its first sight and stored on its second; the modes'
decisions are unit-tested in ``tests/store/test_admission.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.prompts import body, ids
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--pic-admission", "second_sight") as s:
        yield s


def _prompt(
    docs: list[str], question: str, head: str = "Notes.\n"
) -> tuple[list[int], list[list[int]]]:
    toks, spans = ids(head), []
    for doc in docs:
        spans.append([len(toks), len(toks) + len(ids(doc))])
        toks += ids(doc)
    return toks + ids(f"Question: {question}\nAnswer:"), spans


def test_a_chunk_is_stored_on_its_second_sight(server: Server) -> None:
    # Distinct first words: no order of them shares a device prefix past "Notes.".
    docs = [
        "Heron log: the Varn light blinks 4 times a minute.\n",
        "Tide table: high water at Varn is at noon.\n",
        "Ferry notice: the Varn boat sails at dawn.\n",
    ]
    toks, spans = _prompt(docs, "How often does it blink?")
    _, d = server.send(body(toks, spans, n=2))
    # First sight: all computed in context, nothing encoded on its own or stored.
    assert (d["sgl_pic_chunk_lookups_total"], d["sgl_pic_chunk_deferred_total"]) == (3, 3)
    assert d["sgl_pic_chunk_misses_total"] == d["sgl_pic_encoded_tokens_total"] == 0
    assert d['sgl_pic_phase_forwards_total{phase="phase1"}'] == 0
    assert d["sgl_pic_recomputed_tokens_total"] == d["sgl_pic_new_tokens_total"]
    # Second sight, in another order: stored.
    toks, spans = _prompt(docs[::-1], "When does the boat sail?")
    _, d = server.send(body(toks, spans, n=2))
    assert d["sgl_pic_chunk_deferred_total"] == 0 and d["sgl_pic_chunk_misses_total"] == 3
    assert d["sgl_pic_encoded_tokens_total"] == sum(e - s for s, e in spans)
    # Third, in a third order: all hit.
    toks, spans = _prompt([docs[1], docs[0], docs[2]], "When is high water?")
    _, d = server.send(body(toks, spans, n=2))
    hits = d['sgl_pic_chunk_hits_total{kind="contiguous"}']
    hits += d['sgl_pic_chunk_hits_total{kind="disjoint"}']
    assert hits == 3 and d["sgl_pic_chunk_misses_total"] == 0
    assert d["sgl_pic_failures_total"] == 0


def test_a_request_of_deferred_chunks_answers_as_exact_prefill(server: Server) -> None:
    # Nothing reused: every token is computed in context, so the answer is plain
    # prefill's (the same tokens without marks run as SGLang's own extend).
    docs = ["Otter census: 41 otters were counted at Brenn.\n", "Weather: rain all week.\n"]
    toks, spans = _prompt(docs, "How many otters were counted?")
    out, d = server.send(body(toks, spans, n=16))
    assert d["sgl_pic_chunk_deferred_total"] == 2
    plain, _ = server.send(body(toks, None, n=16))
    assert out["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize("policy", ["query_aware", "cachetune", "cacheblend"])
def test_a_deferred_chunk_beside_hits_and_stored_misses(server: Server, policy: str) -> None:
    # One request with a hit, a first sight (deferred) and a second sight (stored): the
    # probe, phase 1 and CacheBlend's deviation pass all run beside a deferred chunk. Each
    # request has its own header, so no device prefix reaches a chunk.
    tag = policy.replace("_", " ")
    a, c, d = (
        f"{w} {tag} note: the {w.lower()} rota changes weekly.\n" for w in ["Ash", "Cob", "Dun"]
    )
    server.send(body(*_prompt([a], "What changes?", f"First, {tag}.\n"), n=2))  # a: first sight
    server.send(body(*_prompt([a], "What changes?", f"Second, {tag}.\n"), n=2))  # a: stored
    server.send(body(*_prompt([d], "Who keeps it?", f"Third, {tag}.\n"), n=2))  # d: first sight
    req = body(*_prompt([a, c, d], "Which rota?", f"Fourth, {tag}.\n"), n=4, policy=policy)
    out, dd = server.send(req)
    hits = dd['sgl_pic_chunk_hits_total{kind="contiguous"}']
    hits += dd['sgl_pic_chunk_hits_total{kind="disjoint"}']
    assert (hits, dd["sgl_pic_chunk_deferred_total"], dd["sgl_pic_chunk_misses_total"]) == (1, 1, 1)
    assert dd["sgl_pic_failures_total"] == 0  # ran through the chunk path, not the fallback
    assert len(out["output_ids"]) == 4
