"""At a 100% recompute budget, chunked requests through sgl_pic give vanilla SGLang's tokens.

One vanilla server (``--pic-disable``) gives the reference tokens; one sgl_pic server runs
every policy that can reach 100%: its own default (CacheTune with r = 1.0, set by flag), and
per-request overrides for ``full_recompute`` and DARIC with an n_avg above every segment.
Each variant sends its requests under its own ``extra_key``, hence its own prefix namespace:
no request is served from the device prefix another variant left behind, so every token of
every prompt goes through the reuse path (chunk lookups, phase 1 for misses, phase 2
recomputing all of it), while the chunk store is shared and later variants hit in it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest

from sgl_pic.core.drift_signal import META_KEY
from tests.support.prompts import body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

# The second and third prompts reuse chunks of the first (in another order), so the store
# path runs; at 100% every new token must still be recomputed.
CASES = [
    (["A", "B", "C"], "Which city lies on the equator?"),
    (["C", "A", "B"], "Where do two rivers meet?"),
    (["B", "D", "C"], "When is the midnight sun seen in Tromso?"),
]
CONTIG = 'sgl_pic_chunk_hits_total{kind="contiguous"}'
DISJOINT = 'sgl_pic_chunk_hits_total{kind="disjoint"}'
KEYS = (
    CONTIG,
    DISJOINT,
    "sgl_pic_requests_total",
    "sgl_pic_chunk_lookups_total",
    "sgl_pic_chunk_misses_total",
    "sgl_pic_chunk_device_prefix_total",
    "sgl_pic_recomputed_tokens_total",
    "sgl_pic_new_tokens_total",
    "sgl_pic_reused_tokens_total",
    "sgl_pic_failures_total",
    "sgl_pic_fallbacks_total",
)
# DARIC at n_avg = 4096: n_2 = r n_avg = 409.6 tokens (default r = 0.1), more than any
# segment here, and the rest grow from there, so every segment but the first is selected.
DARIC_ALL = {"policy": "daric", "daric_n_avg": 4096.0}


ENTROPY_COUNT = "sgl_pic_first_token_entropy_count"
FORWARD = 'sgl_pic_forward_seconds_total{mode="%s"}'
FORWARDS = 'sgl_pic_forwards_total{mode="%s"}'
REQUESTS = 'sgl_pic_forward_requests_total{mode="%s"}'


@pytest.fixture(scope="module")
def vanilla_all() -> tuple[list[list[int]], dict[str, float], float]:
    """Vanilla's outputs, the /metrics series they moved (``forward_timer`` runs on
    ``--pic-disable`` too: bench/workloads.py's ideal reads it there), and, after those,
    the entropy of the first case's first-token distribution from its log-probabilities of
    every token of the vocabulary."""
    from sgl_pic.model.embedded import ensure_embedded_model

    vocab = json.loads((ensure_embedded_model().path / "config.json").read_text())["vocab_size"]
    with launch("--pic-disable", "--enable-metrics") as server:
        before = server.metrics()
        outs = []
        for names, question in CASES:
            toks, _ = chunked(names, question)
            r = server.generate(body(toks, None, n=16))
            assert r.status_code == 200, r.text
            outs.append(r.json()["output_ids"])
            assert META_KEY not in r.json()["meta_info"]  # served by reuse only
        after = server.metrics()
        req = body(chunked(*CASES[0])[0], None, n=1)
        req.update(return_logprob=True, top_logprobs_num=vocab)
        r = server.generate(req)
        assert r.status_code == 200, r.text
        logp = [entry[0] for entry in r.json()["meta_info"]["output_top_logprobs"][0]]
    assert len(logp) == vocab
    entropy = -sum(math.exp(lp) * lp for lp in logp)
    return outs, {k: v - before.get(k, 0.0) for k, v in after.items()}, entropy


@pytest.fixture(scope="module")
def vanilla_run(
    vanilla_all: tuple[list[list[int]], dict[str, float], float],
) -> tuple[list[list[int]], dict[str, float]]:
    return vanilla_all[0], vanilla_all[1]


@pytest.fixture(scope="module")
def vanilla_outputs(vanilla_run: tuple[list[list[int]], dict[str, float]]) -> list[list[int]]:
    return vanilla_run[0]


@pytest.fixture(scope="module")
def vanilla_entropy(vanilla_all: tuple[list[list[int]], dict[str, float], float]) -> float:
    return vanilla_all[2]


def test_vanilla_server_times_its_forwards_by_kind(
    vanilla_run: tuple[list[list[int]], dict[str, float]],
) -> None:
    outs, moved = vanilla_run
    # Three prompts prefilled, 16 tokens decoded each: both kinds of forward took time.
    assert moved[FORWARD % "extend"] > 0.0, moved
    assert moved[FORWARD % "decode"] > 0.0, moved
    assert moved[FORWARD % "other"] == 0.0, moved
    # One request at a time: one extend forward each, then decode steps of that request
    # alone, at least one per output token after the first.
    assert moved[FORWARDS % "extend"] == moved[REQUESTS % "extend"] == len(CASES), moved
    steps = moved[FORWARDS % "decode"]
    assert moved[REQUESTS % "decode"] == steps >= sum(len(o) - 1 for o in outs), moved
    # Nothing of the chunk path exists on a vanilla server.
    assert not any(k.startswith("sgl_pic_requests") for k in moved), moved


@pytest.fixture(scope="module")
def full_budget_server() -> Iterator[Server]:
    with launch("--pic-policy", "cachetune", "--pic-cachetune-r", "1.0") as server:
        yield server


def _spans(names: list[str], question: str, first_token_fresh: bool) -> tuple[list, list]:
    toks, spans = chunked(names, question)
    if first_token_fresh:
        # DARIC (like EPIC) never selects the first segment: a chunk at position 0 keeps its
        # independent KV, which is its prefix KV in exact arithmetic but not bit for bit.
        # With the prompt's first token left outside every chunk, that first segment is one
        # fresh token (always computed) and DARIC can select everything after it. Same token
        # ids, so vanilla's outputs still apply; the shortened first chunk has its own key.
        spans[0][0] += 1
    return toks, spans


def _selects_everything(toks: list[int], spans: list[list[int]], overrides: dict) -> bool:
    """Whether the policy of ``overrides`` recomputes every token of this prompt offline."""
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.selection import SelectionContext, finalize, make_policy

    layout = PromptLayout.from_spans(len(toks), spans)
    policy = make_policy(PicConfig().with_overrides(**overrides))
    sel = finalize(policy.select(SelectionContext(layout)), layout, 0).indices
    return sel.tolist() == list(range(len(toks)))


@pytest.mark.parametrize(
    ("overrides", "first_token_fresh", "min_hits"),
    [
        # The server's own default: CacheTune, r = 1.0 by flag (no per-request config).
        pytest.param({}, False, 5, id="cachetune_r1_server_default"),
        pytest.param({"policy": "cachetune", "cachetune_r": 1.0}, False, 5, id="cachetune_r1"),
        pytest.param({"policy": "full_recompute"}, False, 5, id="full_recompute"),
        pytest.param(DARIC_ALL, True, 2, id="daric_n_avg_4096"),
    ],
)
def test_full_budget_equals_vanilla(
    vanilla_outputs: list[list[int]],
    vanilla_entropy: float,
    full_budget_server: Server,
    overrides: dict,
    first_token_fresh: bool,
    min_hits: int,
) -> None:
    server = full_budget_server
    namespace = "exactness-" + "-".join(f"{k}={v}" for k, v in overrides.items())
    before = server.metrics()
    total_tokens = 0
    entropies: list[float] = []
    for (names, question), expected in zip(CASES, vanilla_outputs, strict=True):
        toks, spans = _spans(names, question, first_token_fresh)
        if overrides.get("policy") == "daric":
            assert _selects_everything(toks, spans, overrides), "DARIC budget below 100%"
        req = body(toks, spans, n=16, **overrides)
        req["extra_key"] = namespace
        r = server.generate(req)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == expected, (overrides, names, question)
        # The drift signal of a request served by reuse: its first token's entropy.
        (served_entropy,) = out["meta_info"][META_KEY]
        assert math.isfinite(served_entropy) and served_entropy >= 0.0, out["meta_info"]
        entropies.append(served_entropy)
        # Nothing came from the device prefix: the whole prompt ran through reuse.
        assert out["meta_info"]["cached_tokens"] == 0, (names, out["meta_info"])
        total_tokens += len(toks)
    after = server.metrics()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in KEYS}
    # The chunked path really ran for every request, chunks were hit, nothing failed.
    assert d["sgl_pic_requests_total"] == len(CASES)
    assert d["sgl_pic_failures_total"] == 0
    assert d["sgl_pic_fallbacks_total"] == 0
    assert d["sgl_pic_chunk_lookups_total"] == sum(len(names) for names, _ in CASES)
    assert d["sgl_pic_chunk_device_prefix_total"] == 0
    hits = d[CONTIG] + d[DISJOINT]
    assert hits >= min_hits, d
    assert hits + d["sgl_pic_chunk_misses_total"] == d["sgl_pic_chunk_lookups_total"]
    # 100%: every token of every prompt recomputed, none of the reused KV kept.
    assert d["sgl_pic_new_tokens_total"] == total_tokens
    assert d["sgl_pic_recomputed_tokens_total"] == d["sgl_pic_new_tokens_total"]
    assert d["sgl_pic_reused_tokens_total"] == 0
    # At 100% the served distribution is exact prefill's: so is its entropy (up to the
    # order of floating-point sums), and the histogram took one value per request.
    assert entropies[0] == pytest.approx(vanilla_entropy, rel=1e-3, abs=1e-4)
    moved = after.get(ENTROPY_COUNT, 0.0) - before.get(ENTROPY_COUNT, 0.0)
    assert moved == len(CASES)
