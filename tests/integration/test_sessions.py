"""A multi-turn agent session under DARIC keeps its hits, and its
per-chunk budgets are monotone (DARIC Proposition 1 with hit-aware refinement).

Turn 1 is [fresh header, tool-schema chunk, doc chunks, question 1]. Turn k + 1 is turn k's
prompt, turn k's output tokens, new chunk(s) and question k + 1, so every chunk span of
turn k keeps its position and SGLang's prefix cache (in sgl_pic's namespace) serves turn
k's prompt to turn k + 1 as exact device prefix. Each new part repeats a chunk seen in an
earlier turn's new part (an agent re-reading a document or the tool list): it must hit.

The server runs with n_avg = 4 instead of DARIC's default 32: the chunks here are about 20
tokens, and at 32 the budget covers every new token, so "the server recomputes what DARIC
selects" would reduce to "the server recomputes everything". At 4 the selection is partial.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from tests.support.prompts import DOCS, body, ids
from tests.support.server import Server, launch
from tests.support.session_checks import (
    CONTIG,
    DISJOINT,
    MISSES,
    PREFIX,
    offline_recompute,
)
from tests.support.session_checks import SESSION_KEYS as KEYS

pytestmark = pytest.mark.sglang

N_AVG = 4.0
HEADER = "System: you are a travel agent. Use the tools and documents below.\n"
TEXTS = {
    "TOOLS": (
        "Tools: search(query: str) -> list[str]; weather(city: str) -> str; "
        "book(city: str, date: str) -> bool.\n"
    ),
    **{name: text + "\n" for name, text in DOCS.items()},
}
TURNS = [
    (["TOOLS", "A", "B"], "Which city has many wooden temples?"),
    (["A", "C"], "Which of these cities lies on the equator?"),
    (["C", "E", "TOOLS"], "Which city is a port with funiculars?"),
]


class Turn(NamedTuple):
    toks: list[int]
    spans: list[list[int]]
    names: list[str]  # chunk name of each span
    new_from: int  # first span index added by this turn
    output: list[int]
    cached: int  # meta_info["cached_tokens"]: the device prefix P
    delta: dict[str, float]  # metrics gained by this request


def _config():  # type: ignore[no-untyped-def]
    from sgl_pic.config import PicConfig

    return PicConfig(policy="daric", daric_n_avg=N_AVG)


def _layout(turn: Turn):  # type: ignore[no-untyped-def]
    from sgl_pic.layout import PromptLayout

    return PromptLayout.from_spans(len(turn.toks), turn.spans)


def _extend(
    toks: list[int], spans: list[list[int]], names: list[str], question: str, head: str = ""
) -> tuple[list[int], list[list[int]]]:
    toks = list(toks) + (ids(head) if head else [])
    spans = [list(s) for s in spans]
    for name in names:
        t = ids(TEXTS[name])
        spans.append([len(toks), len(toks) + len(t)])
        toks += t
    return toks + ids("Question: " + question + "\nAnswer:"), spans


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--pic-policy", "daric", "--pic-n-avg", str(N_AVG)) as s:
        yield s


@pytest.fixture(scope="module")
def session(server: Server) -> list[Turn]:
    """Runs the three turns; each with its prompt, output, device prefix and metric deltas."""
    turns: list[Turn] = []
    toks: list[int] = []
    spans: list[list[int]] = []
    all_names: list[str] = []
    for k, (names, question) in enumerate(TURNS):
        if k == 0:
            toks, spans = _extend([], [], names, question, head=HEADER)
        else:
            prev = turns[-1]
            toks, spans = _extend(prev.toks + prev.output, prev.spans, names, question)
        new_from = len(all_names)
        all_names = all_names + names
        before = server.metrics()
        r = server.generate(body(toks, spans, n=12))
        assert r.status_code == 200, r.text
        after = server.metrics()
        out = r.json()
        delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in KEYS}
        turns.append(
            Turn(
                toks,
                spans,
                all_names,
                new_from,
                out["output_ids"],
                int(out["meta_info"]["cached_tokens"]),
                delta,
            )
        )
    return turns


def _offline(turn: Turn, prefix: int) -> torch.Tensor:
    return offline_recompute(_layout(turn), prefix, _config())


def test_turns_run_through_the_chunk_path(session: list[Turn]) -> None:
    for k, turn in enumerate(session):
        d = turn.delta
        assert d["sgl_pic_requests_total"] == 1, (k, d)
        assert d["sgl_pic_failures_total"] == 0, (k, d)
        assert d["sgl_pic_fallbacks_total"] == 0, (k, d)
        assert d["sgl_pic_chunk_lookups_total"] == len(turn.spans), (k, d)
        assert d["sgl_pic_new_tokens_total"] == len(turn.toks) - turn.cached, (k, d)
        assert turn.output, k


def test_later_turns_hit_the_previous_turn_as_device_prefix(session: list[Turn]) -> None:
    assert session[0].cached == 0  # a fresh server: nothing to hit yet
    for k in range(1, len(session)):
        prev, turn = session[k - 1], session[k]
        # SGLang cached turn k-1's prompt and its output (but the last output token, whose
        # KV was never computed) under sgl_pic's namespace; turn k starts with exactly those.
        assert len(prev.toks) <= turn.cached <= len(prev.toks) + len(prev.output), (k, turn)
        # Every chunk of turn k-1 lies inside the device prefix: counted there, never looked
        # up in the store, missed or recomputed.
        layout = _layout(turn)
        inside = [s for s in layout.chunks if s.end <= turn.cached]
        assert len(inside) == len(prev.spans) == turn.new_from, (k, turn.cached)
        assert turn.delta[PREFIX] == len(prev.spans), (k, turn.delta)
        # No chunk straddles the prefix: it ends among turn k-1's output tokens (fresh).
        assert not any(s.start < turn.cached < s.end for s in layout.chunks)


def test_chunks_seen_in_earlier_turns_hit(session: list[Turn]) -> None:
    seen: set[str] = set()
    for k, turn in enumerate(session):
        new = turn.names[turn.new_from :]
        repeated = [n for n in new if n in seen]
        fresh = [n for n in new if n not in seen]
        d = turn.delta
        assert d[CONTIG] + d[DISJOINT] == len(repeated), (k, repeated, d)
        assert d[MISSES] == len(fresh), (k, fresh, d)
        seen.update(new)
    # The scenario really repeats chunks: A (turn 1) in turn 2, C (turn 2) and the tool
    # schema (turn 1) in turn 3; turn 3's schema follows the miss E, so it is disjoint.
    assert (session[1].delta[CONTIG], session[1].delta[DISJOINT]) == (1, 0)
    assert (session[2].delta[CONTIG], session[2].delta[DISJOINT]) == (1, 1)


def test_recomputed_tokens_equal_the_offline_selection(session: list[Turn]) -> None:
    for k, turn in enumerate(session):
        sel = _offline(turn, turn.cached)
        d = turn.delta
        assert d["sgl_pic_recomputed_tokens_total"] == sel.numel(), (k, sel.tolist(), d)
        # The selection is partial: some new token is reused (the test can tell).
        assert sel.numel() < len(turn.toks) - turn.cached, k
        # Reused tokens: store hits past the prefix, minus those recomputed.
        layout = _layout(turn)
        hit_names = set(turn.names[: turn.new_from])  # every chunk of earlier turns
        hits = [
            s
            for s, name in zip(layout.chunks, turn.names, strict=True)
            if s.start >= turn.cached and name in hit_names
        ]
        kept = sum(s.length - int(((sel >= s.start) & (sel < s.end)).sum()) for s in hits)
        assert d["sgl_pic_reused_tokens_total"] == kept, (k, d)


def test_daric_budgets_are_monotone_across_turns(session: list[Turn]) -> None:
    """Proposition 1: for a chunk present at turn k (segment i of M_k), n_i(M_{k+1}) <=
    n_i(M_k); and with hit-aware refinement no token inside the device prefix is
    recomputed, though DARIC's unrefined selection would pick some there."""
    from sgl_pic.selection import daric_budget

    cfg = _config()
    strictly_smaller = 0
    for k in range(len(session) - 1):
        segs = _layout(session[k]).segments()
        nxt = _layout(session[k + 1]).segments()
        b_k = daric_budget(len(segs), cfg.daric_n_avg, cfg.daric_r, cfg.daric_mtaf)
        b_next = daric_budget(len(nxt), cfg.daric_n_avg, cfg.daric_r, cfg.daric_mtaf)
        assert len(nxt) > len(segs)
        for i, seg in enumerate(segs):
            if not seg.reusable or i == 0:
                continue  # budgets are for segments 2..M
            # The chunk keeps its place, hence its segment index, in the next turn.
            assert nxt[i] == seg, (k, i)
            assert b_next.per_chunk[i - 1] <= b_k.per_chunk[i - 1] + 1e-9, (k, i)
            assert b_next.per_chunk_tokens[i - 1] <= b_k.per_chunk_tokens[i - 1], (k, i)
            strictly_smaller += b_next.per_chunk[i - 1] < b_k.per_chunk[i - 1] - 1e-9
    assert strictly_smaller > 0  # the budget really moved to the newer chunks

    for k in range(1, len(session)):
        turn = session[k]
        layout = _layout(turn)
        prefix_chunks = [s for s in layout.chunks if s.end <= turn.cached]
        refined = _offline(turn, turn.cached)
        unrefined = _offline(turn, 0)

        def in_prefix_chunks(sel: torch.Tensor, chunks: list = prefix_chunks) -> int:
            return sum(int(((sel >= s.start) & (sel < s.end)).sum()) for s in chunks)

        assert in_prefix_chunks(refined) == 0, k
        assert in_prefix_chunks(unrefined) > 0, k  # refinement removed something
        # The server recomputed the refined set's size, not the unrefined one's.
        assert turn.delta["sgl_pic_recomputed_tokens_total"] == refined.numel(), k
        assert refined.numel() != unrefined.numel(), k


def test_session_prefix_never_serves_a_plain_request(server: Server, session: list[Turn]) -> None:
    # Turn 2's prompt got a device prefix as a chunked request ...
    turn = session[1]
    assert turn.cached >= len(session[0].toks)
    # ... but that KV is approximate (reused chunks) and lives in sgl_pic's prefix
    # namespace: the same tokens sent without marks are prefilled exactly, from scratch.
    before = server.metrics()
    r = server.generate(body(turn.toks, None, n=4))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["cached_tokens"] == 0
    after = server.metrics()
    assert after["sgl_pic_requests_total"] == before["sgl_pic_requests_total"]
