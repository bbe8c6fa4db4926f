"""Prompts longer than SGLang's --chunked-prefill-size: the pieces before the last run as
SGLang's exact prefill; the last piece reuses the chunks that lie wholly inside it, with
everything before it as device prefix (hit-aware refinement)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.prompts import body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

PIECE = 64
NAMES = ["A", "B", "C", "D", "E"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--chunked-prefill-size", str(PIECE)) as s:
        yield s


def test_long_prompt_reuses_chunks_of_its_last_piece(server: Server) -> None:
    # Cache the chunks where they land past the first piece in either order.
    for names in (NAMES, NAMES[::-1]):
        toks, spans = chunked(names, "Name a city.", header="Pelican log.\n")
        assert len(toks) > PIECE
        assert server.generate(body(toks, spans, n=1)).status_code == 200

    toks, spans = chunked(NAMES[1:] + NAMES[:1], "Which city is on the equator?", header="Owl.\n")
    plain, _ = server.send(body(toks, None))
    exact, d = server.send(body(toks, spans, policy="full_recompute"))
    # Everything recomputed on top of an exact prefix: SGLang's own output.
    assert exact["output_ids"] == plain["output_ids"]
    assert d["sgl_pic_fallbacks_total"] >= 1  # the pieces before the last
    hits = (
        d['sgl_pic_chunk_hits_total{kind="contiguous"}']
        + d['sgl_pic_chunk_hits_total{kind="disjoint"}']
    )
    last_start = (len(toks) - 1) // PIECE * PIECE
    inside_last = sum(1 for s, _ in spans if s >= last_start)
    assert hits >= inside_last >= 1
    assert d["sgl_pic_failures_total"] == 0

    # The same order again (the chunk in its last piece is cached now, whether the request
    # above hit or encoded it), another header and question: what is found is reused.
    toks, spans = chunked(NAMES[1:] + NAMES[:1], "Where do rivers meet?", header="Crane.\n")
    _, d = server.send(body(toks, spans, policy="full_reuse"))
    assert d["sgl_pic_failures_total"] == 0
    assert d["sgl_pic_reused_tokens_total"] > 0
