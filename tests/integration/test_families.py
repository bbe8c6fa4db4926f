"""Chunk reuse on every decoder family, end to end on the CPU: Qwen2 (QKV bias), Qwen3
(QK-norm), Mistral, Llama with Llama 3 RoPE scaling and Llama with YaRN.

One server per family, over a tiny random-weight checkpoint written at test time
(``tiny_models``; the embedded model's tokenizer, so ``prompts`` apply). Per family:

* SGLang serves the checkpoint as the oracle computes it (plain greedy tokens);
* at a 100% budget (``full_recompute``, CacheTune r = 1) a chunked request gives the
  tokens of the plain request for the same ids, on a cold cache. Plain requests take
  SGLang's own path, so that is vanilla SGLang's output; the metrics prove the chunk
  path ran (a request counted, no fallback, no failure, every token recomputed);
* at partial budgets (EPIC, DARIC, CacheBlend), two chunks cached by one request and
  reused by another in a new order give the oracle's last-token logprobs within 1e-3.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tests.support.prompts import body, chunked
from tests.support.server import Server, launch
from tests.support.tiny_models import FAMILIES, LLAMA3_ROPE, YARN_ROPE, write_tiny_model

pytestmark = pytest.mark.sglang

NEW_TOKENS = 8
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
    "sgl_pic_prefix_hit_tokens_total",
    "sgl_pic_failures_total",
    "sgl_pic_fallbacks_total",
)
# The second prompt reuses two chunks of the first in another order, so the store path
# (lookup, hit, re-rotation to new positions) runs before everything is recomputed.
CASES = [
    (["A", "B", "C"], "Which city lies on the equator?"),
    (["C", "A"], "Where do two rivers meet?"),
]


# Families whose RoPE is scaled, with the theta of their unscaled frequencies.
SCALED_ROPE_THETA = {
    "llama_scaled": float(LLAMA3_ROPE["rope_theta"]),
    "llama_yarn": float(YARN_ROPE["rope_theta"]),
}


class Family(NamedTuple):
    name: str
    path: Path
    server: Server


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    from sgl_pic.model.embedded import ensure_embedded_model

    name = request.param
    tiny = write_tiny_model(name, tmp_path_factory.mktemp(name), ensure_embedded_model().path)
    with launch("--model-path", str(tiny.path)) as server:
        yield Family(name, tiny.path, server)


@pytest.fixture(scope="module")
def oracle(family: Family) -> Any:  # an Oracle of the family's checkpoint
    from sgl_pic.oracle import Oracle

    return Oracle.from_pretrained(family.path)


def _generate(server: Server, req: dict) -> tuple[dict, dict[str, float]]:
    """The response and the change of every ``KEYS`` counter across it."""
    before = server.metrics()
    r = server.generate(req)
    assert r.status_code == 200, r.text
    after = server.metrics()
    return r.json(), {k: after.get(k, 0.0) - before.get(k, 0.0) for k in KEYS}


def _request(toks: list[int], spans: list[list[int]] | None, key: str, **pic: object) -> dict:
    req = body(toks, spans, n=NEW_TOKENS, **pic)
    req["sampling_params"]["ignore_eos"] = True  # always NEW_TOKENS tokens to compare
    req["extra_key"] = key
    return req


def test_chunk_reuse_is_supported(family: Family) -> None:
    unsupported = {k: v for k, v in family.server.metrics().items() if "unsupported" in k}
    assert not any(unsupported.values()), (family.name, unsupported)


def test_plain_request_gives_the_oracles_greedy_tokens(family: Family, oracle: Any) -> None:
    # SGLang loads the checkpoint as transformers does (the oracle equals transformers
    # per tests/oracle/test_families.py): same weights, biases, norms and RoPE scaling.
    toks, _ = chunked(["D", "E"], "Which port has funiculars?")
    out, d = _generate(family.server, _request(toks, None, "families-plain"))
    assert d["sgl_pic_requests_total"] == 0  # a plain request is SGLang's own
    full = oracle.prefill(torch.tensor(toks))
    expected = oracle.generate(full.kv, full.logits, NEW_TOKENS).tolist()
    assert out["output_ids"] == expected, family.name


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"policy": "full_recompute"}, id="full_recompute"),
        pytest.param({"policy": "cachetune", "cachetune_r": 1.0}, id="cachetune_r1"),
    ],
)
def test_full_budget_equals_plain_prefill(family: Family, overrides: dict) -> None:
    server = family.server
    # Own namespaces: nothing comes from another variant's (or the plain requests')
    # device prefix, so both requests run cold and every token goes through reuse.
    key = "families-" + "-".join(f"{k}={v}" for k, v in overrides.items())
    hits = 0.0
    for names, question in CASES:
        toks, spans = chunked(names, question)
        plain, d = _generate(server, _request(toks, None, key + "-plain"))
        assert plain["meta_info"]["cached_tokens"] == 0
        assert d["sgl_pic_requests_total"] == 0
        out, d = _generate(server, _request(toks, spans, key, **overrides))
        assert out["output_ids"] == plain["output_ids"], (family.name, overrides, names)
        assert out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
        # The chunked path ran, whole: counted, nothing fell back or failed, every chunk
        # looked up, and at 100% every token recomputed with none of the reused KV kept.
        assert d["sgl_pic_requests_total"] == 1, d
        assert d["sgl_pic_fallbacks_total"] == 0, d
        assert d["sgl_pic_failures_total"] == 0, d
        assert d["sgl_pic_chunk_lookups_total"] == len(names), d
        assert d["sgl_pic_new_tokens_total"] == len(toks), d
        assert d["sgl_pic_recomputed_tokens_total"] == len(toks), d
        assert d["sgl_pic_reused_tokens_total"] == 0, d
        hits += d[CONTIG] + d[DISJOINT]
    # C and A of the second prompt were cached by the first (or by the other variant).
    assert hits >= 2


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"policy": "epic", "epic_k": 4}, id="epic_k4"),
        pytest.param({"policy": "daric", "daric_n_avg": 8.0}, id="daric_n8"),
        pytest.param({"policy": "cacheblend", "cacheblend_ratio": 0.3}, id="cacheblend_0.3"),
        pytest.param({"policy": "query_aware", "qa_ratio": 0.3}, id="query_aware_0.3"),
    ],
)
def test_partial_budget_matches_oracle(family: Family, oracle: Any, overrides: dict) -> None:
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.selection import make_policy

    server = family.server
    key = "families-partial-" + overrides["policy"]
    # Caches A and B (whatever it computes itself is not compared).
    _generate(server, _request(*chunked(["A", "B"], "Where is Kyoto?"), key))
    # B and A again, in the other order and at other positions: a fresh header no other
    # prompt starts with keeps the device prefix empty.
    toks, spans = chunked(["B", "A"], "Which city has temples?", header="Zebra note 17.\n")
    req = _request(toks, spans, key, **overrides)
    req["sampling_params"]["max_new_tokens"] = 1
    req.update(return_logprob=True, top_logprobs_num=8)
    out, d = _generate(server, req)
    assert out["meta_info"]["cached_tokens"] == 0
    assert d["sgl_pic_requests_total"] == 1, d
    assert d["sgl_pic_fallbacks_total"] == 0, d
    assert d["sgl_pic_failures_total"] == 0, d
    assert d[CONTIG] + d[DISJOINT] == 2 and d["sgl_pic_chunk_misses_total"] == 0, d
    # A partial budget: some reused KV kept.
    assert 0 < d["sgl_pic_recomputed_tokens_total"] < d["sgl_pic_new_tokens_total"], d
    assert d["sgl_pic_reused_tokens_total"] > 0, d

    t = torch.tensor(toks)
    layout = PromptLayout.from_spans(len(toks), spans)
    chunks = [oracle.encode_chunk(t[s:e]) for s, e in spans]
    policy = make_policy(PicConfig().with_overrides(**overrides))
    # The server's own L_hit (device prefix or contiguous hits), which DARIC and EPIC read.
    prefix_hit = int(d["sgl_pic_prefix_hit_tokens_total"])
    res = oracle.reuse(t, layout, chunks, policy, prefix_hit=prefix_hit)
    # The same selection (a different set of the same size would show in the logprobs).
    assert d["sgl_pic_recomputed_tokens_total"] == res.computed.indices.numel(), d
    ref = torch.log_softmax(res.logits.double(), -1)
    full = torch.log_softmax(oracle.prefill(t).logits.double(), -1)
    top = out["meta_info"]["output_top_logprobs"][0]  # [[logprob, token_id, text], ...]
    for logprob, token_id, _ in top:
        assert abs(logprob - float(ref[token_id])) < 1e-3, (
            family.name,
            token_id,
            logprob,
            float(ref[token_id]),
        )
    # The comparison can tell this reuse from full prefill on this prompt.
    assert max(abs(float(full[tid]) - float(ref[tid])) for _, tid, _ in top) > 1e-3
    if family.name in SCALED_ROPE_THETA:
        # ... and the model's scaled RoPE from plain RoPE in the re-rotation of reused keys:
        # the server's logprobs are far from those of a plain-RoPE re-rotation.
        wrong = _plain_rotation_logprobs(oracle, t, layout, chunks, res.computed, family.name)
        assert max(abs(lp - float(wrong[tid])) for lp, tid, _ in top) > 1e-2


def _plain_rotation_logprobs(
    oracle: Any, t: torch.Tensor, layout: Any, chunks: list, computed: Any, name: str
) -> torch.Tensor:
    """# [vocab] the oracle's logprobs had the reused keys been re-rotated with unscaled
    frequencies (the rest of the forward unchanged)."""
    import dataclasses

    from sgl_pic.oracle import Oracle
    from sgl_pic.rope import default_inv_freq

    plain = default_inv_freq(oracle.w.head_dim, SCALED_ROPE_THETA[name])
    assembled = Oracle(dataclasses.replace(oracle.w, inv_freq=plain)).assemble(t, layout, chunks)
    return torch.log_softmax(oracle.recompute(t, assembled, computed).logits.double(), -1)
