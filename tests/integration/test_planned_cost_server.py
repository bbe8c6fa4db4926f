"""A chunked prompt longer than --chunked-prefill-size whose planned cost fits one piece
is prefilled whole, reusing every chunk it finds (``binding.cost_adder``, through the hook
``plugin.register`` registers: ``hooks.PrefillAdderFactory``): no piece runs without
reuse."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.prompts import body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

PIECE = 48
NAMES = ["A", "B", "C", "D", "E"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--chunked-prefill-size", str(PIECE)) as s:
        yield s


def hits(d: dict[str, float]) -> float:
    return (
        d['sgl_pic_chunk_hits_total{kind="contiguous"}']
        + d['sgl_pic_chunk_hits_total{kind="disjoint"}']
    )


def test_a_cheap_long_request_is_not_split(server: Server) -> None:
    # Cold, every chunk is encoded: the cost does not fit a piece, and the prompt is cut
    # as SGLang cuts it (planned whole at its first piece, ``engine.pieces``).
    toks, spans = chunked(NAMES, "Name a city.", header="Pelican log.\n")
    assert len(toks) > 2 * PIECE
    _, cold = server.send(body(toks, spans, n=1, policy="full_reuse"))
    assert cold["sgl_pic_split_requests_total"] == 1
    assert cold["sgl_pic_fallbacks_total"] == 0
    # Each chunk alone, in a prompt shorter than a piece: every chunk is cached.
    for name in NAMES:
        t, s = chunked([name], "Name a city.")
        assert len(t) <= PIECE
        assert server.generate(body(t, s, n=1, policy="full_reuse")).status_code == 200

    # Warm and reordered: every chunk is found, and the request is prefilled whole.
    toks, spans = chunked(NAMES[1:] + NAMES[:1], "Which city is on the equator?", header="Owl.\n")
    assert len(toks) > 2 * PIECE
    _, d = server.send(body(toks, spans, policy="full_reuse"))
    assert d["sgl_pic_split_requests_total"] == 0  # one piece: taken whole
    assert d["sgl_pic_fallbacks_total"] == 0
    assert d["sgl_pic_failures_total"] == 0
    assert hits(d) == len(NAMES)
