"""Prompts longer than SGLang's --chunked-prefill-size: a chunked request is planned once,
at its first prefill piece, over its whole prompt, and each piece runs its share
(``sgl_pic.engine.pieces``). Where SGLang cuts must not matter: the same request sequence
through a server that cuts into small pieces gives the unsplit server's tokens, first
-token distribution and recomputed set, request by request; and a split full-reuse
request is the oracle's reuse of its whole prompt."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from tests.support.prompts import body, chunked, ids
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

NAMES = ["A", "B", "C", "D", "E"]
# The piece size the split server cuts at, drawn at random (seeded, so a failure
# reproduces; several pieces per prompt, so that over prompts of different lengths cuts
# fall inside chunks, on their edges and in the question). Below what a warm request's
# planned cost takes from the budget, so that SGLang cuts warm requests too
# (``binding.cost_adder`` takes a request whole where its planned cost fits).
PIECES = [random.Random(45).randrange(17, 24)]
TOP = 10
IBIS = (
    "Ibis field notes, copied in full from the survey ledger kept at the northern marsh "
    "station during the long wet season of that year.\n"
)
STEPS = [
    # (order, question, header, per-request config): a cold request first (every chunk a
    # miss, encoded in whichever piece it lies), then reordered warm ones per policy.
    (NAMES, "Name a city.", "Pelican log.\n", {}),
    (NAMES[2:] + NAMES[:2], "Which city is on the equator?", "Owl.\n", {}),
    (NAMES[::-1], "Where do rivers meet?", "Crane notes.\n", {"policy": "cacheblend"}),
    (NAMES[1:] + NAMES[:1], "Which port has funiculars?", "Heron.\n", {"policy": "epic"}),
    # A long fresh header: full reuse computes only fresh text, and this keeps its planned
    # cost above a piece, so that SGLang cuts it (the oracle test below).
    (NAMES[3:] + NAMES[:3], "Where is the midnight sun?", IBIS, {"policy": "full_reuse"}),
    (NAMES[::2] + NAMES[1::2], "Which capital had temples?", "Kite.\n", {"policy": "cachetune"}),
]


class Outcome(NamedTuple):
    extend: int  # prompt tokens past the device prefix
    tokens: list[int]
    top: dict[int, float]  # the first output token's top logprobs
    recomputed: float
    reused: float
    split: float
    fallbacks: float
    failures: float


def _send(server: Server, req: dict[str, Any]) -> Outcome:
    req = {**req, "return_logprob": True, "top_logprobs_num": TOP}
    req["sampling_params"]["ignore_eos"] = True  # eight tokens compared, not an early stop
    out, d = server.send(req)
    meta = out["meta_info"]
    top = {int(t): lp for lp, t, _ in meta["output_top_logprobs"][0]}
    return Outcome(
        len(req["input_ids"]) - meta["cached_tokens"],
        out["output_ids"],
        top,
        d["sgl_pic_recomputed_tokens_total"],
        d["sgl_pic_reused_tokens_total"],
        d["sgl_pic_split_requests_total"],
        d["sgl_pic_fallbacks_total"],
        d["sgl_pic_failures_total"],
    )


def _sequence(server: Server) -> list[Outcome]:
    """The same requests, in the same order, on a fresh server: each step, then a later
    turn of the first one (its prompt is now device prefix, so the first piece starts past
    position 0)."""
    outcomes = []
    first: tuple[list[int], list[list[int]]] | None = None
    for names, question, header, config in STEPS:
        toks, spans = chunked(names, question, header=header)
        first = first or (toks, spans)
        outcomes.append(_send(server, body(toks, spans, n=8, **config)))
    assert first is not None
    toks, spans = first
    turn = toks + outcomes[0].tokens + ids("\nAnd another one?\n")
    more, _ = chunked(["C", "B"], "Name a river.")
    grown = turn + more
    shift = len(turn)
    spans = spans + [[a + shift, b + shift] for a, b in chunked(["C", "B"], "x")[1]]
    outcomes.append(_send(server, body(grown, spans, n=8)))
    return outcomes


@pytest.fixture(scope="module")
def unsplit() -> list[Outcome]:
    with launch() as server:
        return _sequence(server)


@pytest.fixture(scope="module", params=PIECES, ids=lambda p: f"piece{p}")
def split(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[Outcome]]]:
    with launch("--chunked-prefill-size", str(request.param)) as server:
        yield request.param, _sequence(server)


def test_the_unsplit_server_takes_each_prompt_in_one_piece(unsplit: list[Outcome]) -> None:
    assert all(o.split == 0 and o.fallbacks == 0 and o.failures == 0 for o in unsplit)
    assert all(o.recomputed > 0 for o in unsplit)
    assert sum(o.reused for o in unsplit[1:]) > 0


def test_where_sglang_cuts_changes_nothing(
    unsplit: list[Outcome], split: tuple[int, list[Outcome]]
) -> None:
    piece, outcomes = split
    assert max(o.extend for o in outcomes) > 2 * piece, "the prompts must span several pieces"
    for i, (whole, cut) in enumerate(zip(unsplit, outcomes, strict=True)):
        where = (piece, i)
        assert cut.failures == 0 and cut.fallbacks == 0, where
        assert cut.extend == whole.extend, where
        # Planned once, at its first piece, when SGLang cut it.
        assert cut.split <= (cut.extend > piece), where
        # The same selection: as many positions recomputed and reused as unsplit.
        assert (cut.recomputed, cut.reused) == (whole.recomputed, whole.reused), where
        assert cut.tokens == whole.tokens, where
        assert cut.top.keys() == whole.top.keys(), where
        worst = max(abs(cut.top[t] - whole.top[t]) for t in whole.top)
        assert worst < 1e-3, (where, worst)
    assert sum(o.split for o in outcomes) >= len(outcomes) - 2, outcomes


def test_a_split_request_is_the_oracles_reuse_of_its_whole_prompt(
    split: tuple[int, list[Outcome]],
) -> None:
    """The full-reuse step, cut into pieces, against the plain-torch oracle's reuse of the
    whole prompt (each chunk's independent KV at its place, fresh text computed over it)."""
    from tests.support.oracle_refs import full_reuse_reference

    piece, outcomes = split
    step = next(i for i, s in enumerate(STEPS) if s[3] == {"policy": "full_reuse"})
    names, question, header, _ = STEPS[step]
    toks, spans = chunked(names, question, header=header)
    got = outcomes[step]
    assert got.split == 1 and got.extend == len(toks) > 2 * piece
    ref, full = full_reuse_reference(toks, spans)
    for token_id, logprob in got.top.items():
        assert abs(logprob - float(ref[token_id])) < 1e-3, (token_id, logprob)
    # The comparison can tell reuse from full prefill apart on this prompt.
    assert max(abs(float(full[t]) - float(ref[t])) for t in got.top) > 1e-3
