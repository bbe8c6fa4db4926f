"""With full_recompute, chunked requests through sgl_pic give vanilla SGLang's tokens."""

from __future__ import annotations

import pytest

from tests.integration.prompts import body, chunked
from tests.integration.server import launch

pytestmark = pytest.mark.sglang

# The second and third prompts reuse chunks of the first (in another order), so the store
# path runs; full_recompute must still recompute every new token.
CASES = [
    (["A", "B", "C"], "Which city lies on the equator?"),
    (["C", "A", "B"], "Where do two rivers meet?"),
    (["B", "D", "C"], "When is the midnight sun seen in Tromso?"),
]


@pytest.fixture(scope="module")
def vanilla_outputs() -> list[list[int]]:
    with launch("--pic-disable") as server:
        outs = []
        for names, question in CASES:
            toks, _ = chunked(names, question)
            r = server.generate(body(toks, None, n=16))
            assert r.status_code == 200, r.text
            outs.append(r.json()["output_ids"])
        return outs


def test_full_recompute_equals_vanilla(vanilla_outputs: list[list[int]]) -> None:
    with launch("--pic-policy", "full_recompute") as server:
        for (names, question), expected in zip(CASES, vanilla_outputs, strict=True):
            toks, spans = chunked(names, question)
            r = server.generate(body(toks, spans, n=16))
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == expected, (names, question)
        m = server.metrics()
        # The chunked path really ran: every request went through it, chunks were hit.
        assert m["sgl_pic_requests_total"] == len(CASES)
        assert m["sgl_pic_failures_total"] == 0
        hits = (
            m['sgl_pic_chunk_hits_total{kind="contiguous"}']
            + m['sgl_pic_chunk_hits_total{kind="disjoint"}']
        )
        assert hits >= 4
        assert m["sgl_pic_recomputed_tokens_total"] == m["sgl_pic_new_tokens_total"]
