"""The oracle's exactness contracts, on a tiny random model (fast) and the real one."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.fidelity import first_token_kl
from sgl_pic.layout import PromptLayout, Span
from sgl_pic.oracle import Oracle, weights_from_hf
from sgl_pic.selection import make_policy
from sgl_pic.selection.base import as_selection, finalize
from tests.conftest import tiny_llama

VOCAB = 97


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _reuse(oracle: Oracle, ids: torch.Tensor, layout: PromptLayout, policy: str, **kw):
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    return oracle.reuse(ids, layout, chunks, make_policy(PicConfig(policy=policy, **kw)))


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2"])
def test_prefill_matches_hf_forward(bias: bool) -> None:
    model = tiny_llama(seed=3, bias=bias)
    oracle = Oracle(weights_from_hf(model))
    ids = _ids(40)
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
    assert torch.allclose(oracle.prefill(ids).logits, ref, atol=1e-4)


def test_generate_matches_hf_greedy(tiny_model: torch.nn.Module, tiny_oracle: Oracle) -> None:
    ids = _ids(30, seed=5)
    full = tiny_oracle.prefill(ids)
    ours = tiny_oracle.generate(full.kv, full.logits, 8)
    with torch.no_grad():
        ref = tiny_model.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=0)[
            0, 30:
        ]
    assert torch.equal(ours, ref)


def test_full_recompute_equals_prefill_exactly(tiny_oracle: Oracle) -> None:
    ids = _ids(60)
    layout = PromptLayout.from_lengths([15, 20, 17], fresh_tail=8)
    full = tiny_oracle.prefill(ids)
    res = _reuse(tiny_oracle, ids, layout, "full_recompute")
    assert torch.allclose(res.logits, full.logits, atol=1e-4)
    assert torch.allclose(res.kv.k, full.kv.k, atol=1e-4)
    assert torch.allclose(res.kv.v, full.kv.v, atol=1e-4)


@pytest.mark.parametrize(
    "policy, override",
    [("cachetune", {"cachetune_r": 1.0}), ("cacheblend", {"cacheblend_ratio": 1.0})],
)
def test_ratio_one_equals_prefill(tiny_oracle: Oracle, policy: str, override: dict) -> None:
    from sgl_pic.selection import cachetune_ranking

    ids = _ids(50, seed=2)
    layout = PromptLayout.from_lengths([12, 14, 16], fresh_tail=8)
    chunks = [
        tiny_oracle.encode_chunk(
            ids[s.start : s.end], ranker=lambda k, v: cachetune_ranking(k, v, 0.5)
        )
        for s in layout.chunks
    ]
    res = tiny_oracle.reuse(ids, layout, chunks, make_policy(PicConfig(policy=policy, **override)))
    assert torch.allclose(res.logits, tiny_oracle.prefill(ids).logits, atol=1e-4)


def test_one_chunk_equals_prefix_reuse(tiny_oracle: Oracle) -> None:
    # A single chunk at position 0 is exactly the prefix: reusing it untouched and
    # computing the tail is ordinary prefix caching.
    ids = _ids(40, seed=7)
    layout = PromptLayout.from_lengths([28], fresh_tail=12)
    res = _reuse(tiny_oracle, ids, layout, "full_reuse")
    assert torch.allclose(res.logits, tiny_oracle.prefill(ids).logits, atol=1e-4)
    assert res.computed.indices.tolist() == list(range(28, 40))


def test_full_reuse_differs_measurably(tiny_oracle: Oracle) -> None:
    ids = _ids(60, seed=8)
    layout = PromptLayout.from_lengths([20, 20, 12], fresh_tail=8)
    res = _reuse(tiny_oracle, ids, layout, "full_reuse")
    assert first_token_kl(tiny_oracle.prefill(ids).logits, res.logits) > 1e-4


def test_recompute_does_not_modify_assembled_or_cached_chunk(tiny_oracle: Oracle) -> None:
    ids = _ids(30, seed=9)
    layout = PromptLayout.from_lengths([10, 12], fresh_tail=8)
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    cached_k = chunks[1].kv.k.clone()
    assembled = tiny_oracle.assemble(ids, layout, chunks)
    before = assembled.clone()
    tiny_oracle.recompute(ids, assembled, finalize(as_selection([10, 11]), layout))
    assert torch.equal(assembled.k, before.k) and torch.equal(assembled.v, before.v)
    assert torch.equal(chunks[1].kv.k, cached_k)


def test_recompute_shows_each_layers_queries_with_the_kv_as_it_stands(
    tiny_oracle: Oracle,
) -> None:
    ids = _ids(30, seed=12)
    layout = PromptLayout.from_lengths([10, 12], fresh_tail=8)
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    assembled = tiny_oracle.assemble(ids, layout, chunks)
    computed = finalize(as_selection([10, 11]), layout)
    idx = computed.indices
    seen: list[int] = []

    def look(layer: int, q: torch.Tensor, kv) -> None:  # q: [len(computed), H, D]
        seen.append(layer)
        assert q.shape[0] == idx.numel()
        # This layer's K of the computed rows are written; the next layer's are not yet.
        assert not torch.equal(kv.k[layer, 10], assembled.k[layer, 10]) or layer == 0
        if layer + 1 < tiny_oracle.w.num_layers:
            assert torch.equal(kv.k[layer + 1, 10], assembled.k[layer + 1, 10])

    plain = tiny_oracle.recompute(ids, assembled, computed)
    hooked = tiny_oracle.recompute(ids, assembled, computed, on_queries=look)
    assert seen == list(range(tiny_oracle.w.num_layers))
    assert torch.equal(plain.logits, hooked.logits)


def test_assembly_rejects_other_tokens(tiny_oracle: Oracle) -> None:
    ids = _ids(30, seed=10)
    layout = PromptLayout.from_lengths([10, 12], fresh_tail=8)
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    other = ids.clone()
    other[12] = (other[12] + 1) % VOCAB
    with pytest.raises(ValueError, match="differ"):
        tiny_oracle.assemble(other, layout, chunks)


def test_recompute_requires_last_token(tiny_oracle: Oracle) -> None:
    ids = _ids(20, seed=11)
    layout = PromptLayout.from_lengths([10, 10])
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    assembled = tiny_oracle.assemble(ids, layout, chunks)
    with pytest.raises(ValueError, match="last token"):
        tiny_oracle.recompute(ids, assembled, as_selection([3]))


def test_deferred_rope_assembly_equals_rerotation(tiny_oracle: Oracle) -> None:
    ids = _ids(45, seed=12)
    layout = PromptLayout.from_lengths([15, 15, 15])
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    post = tiny_oracle.assemble(ids, layout, chunks)
    pre = tiny_oracle.assemble(ids, layout, chunks, deferred_rope=True)
    assert torch.allclose(post.k, pre.k, atol=1e-5)
    assert torch.equal(post.v, pre.v)


def test_shared_prefix_chunk_encoding(tiny_oracle: Oracle) -> None:
    # A chunk encoded after the system prefix, reused right after that same prefix,
    # is exact prefix caching again.
    ids = _ids(40, seed=13)
    prefix = tiny_oracle.prefill(ids[:10]).kv
    chunk = tiny_oracle.encode_chunk(ids[10:30], prefix=prefix)
    full = tiny_oracle.prefill(ids)
    assert chunk.base_position == 10
    assert torch.allclose(chunk.kv.k, full.kv.k[:, 10:30], atol=1e-5)
    assert torch.allclose(chunk.kv.v, full.kv.v[:, 10:30], atol=1e-5)


def test_rerotation_is_exact_on_the_real_model(real_oracle: Oracle, tokenizer) -> None:
    text = "The Punica is a Latin epic poem in seventeen books written by Silius Italicus."
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    at0 = real_oracle.encode_chunk(ids)
    for p in (17, 1234):
        at_p = real_oracle.encode_chunk(ids, start_position=p)
        layout = PromptLayout(p + ids.numel(), (Span(p, p + ids.numel()),))
        prompt = torch.cat([torch.zeros(p, dtype=torch.int64), ids])
        moved = real_oracle.assemble(prompt, layout, [at0])
        assert torch.allclose(moved.k[:, p:], at_p.kv.k, atol=1e-4)
        assert torch.allclose(moved.v[:, p:], at_p.kv.v, atol=1e-4)


def test_real_model_full_recompute_exact_and_reuse_differs(real_oracle: Oracle, tokenizer) -> None:
    pieces = [
        "Passage: Exeter College is a constituent college of the University of Oxford.\n\n",
        "Passage: Thomas Nabbes was an English dramatist who studied at Exeter College.\n\n",
        "Question: Where was Thomas Nabbes educated?\nAnswer:",
    ]
    chunk_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces]
    ids = torch.tensor([t for c in chunk_ids for t in c])
    layout = PromptLayout.from_lengths(
        [len(c) for c in chunk_ids[:2]], fresh_tail=len(chunk_ids[2])
    )
    full = real_oracle.prefill(ids)
    exact = _reuse(real_oracle, ids, layout, "full_recompute")
    assert torch.allclose(exact.logits, full.logits, atol=1e-4)
    reused = _reuse(real_oracle, ids, layout, "full_reuse")
    assert first_token_kl(full.logits, reused.logits) > 1e-3


def test_batched_greedy_equals_one_at_a_time(tiny_oracle: Oracle) -> None:
    ids = _ids(36, seed=14)
    layout = PromptLayout.from_lengths([12, 12], fresh_tail=12)
    full = tiny_oracle.prefill(ids)
    reused = _reuse(tiny_oracle, ids, layout, "full_reuse")
    batch = tiny_oracle.generate_batch(
        [full.kv, reused.kv], torch.stack([full.logits, reused.logits]), 10
    )
    assert torch.equal(batch[0], tiny_oracle.generate(full.kv, full.logits, 10))
    assert torch.equal(batch[1], tiny_oracle.generate(reused.kv, reused.logits, 10))


def test_batched_greedy_matches_on_the_real_model(real_oracle: Oracle, tokenizer) -> None:
    ids = torch.tensor(
        tokenizer(
            "The capital of France is Paris. The capital of Italy is", add_special_tokens=False
        )["input_ids"]
    )
    full = real_oracle.prefill(ids)
    one = real_oracle.generate(full.kv, full.logits, 8)
    batch = real_oracle.generate_batch([full.kv, full.kv], torch.stack([full.logits] * 2), 8)
    assert torch.equal(batch[0], one) and torch.equal(batch[1], one)


def test_query_attention_at_layer_zero_is_the_question_scoring_the_assembled_keys(
    tiny_oracle: Oracle,
) -> None:
    from sgl_pic.oracle.forward import project_qkv
    from sgl_pic.rope import apply_rope
    from sgl_pic.selection.query_aware import query_positions, question_attention

    w = tiny_oracle.w
    ids = _ids(52, seed=7)
    layout = PromptLayout.from_spans(52, [[0, 12], [12, 30], [34, 46]])  # fresh 30-34, 46-52
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    asm = tiny_oracle.assemble(ids, layout, chunks)
    got = tiny_oracle.query_attention(ids, layout, asm, num_layers=1)
    # Layer 0 needs no context: the fresh tokens' K and the question's q come from their
    # embeddings alone.
    fresh = torch.tensor(layout.fresh_indices())
    q, k, _ = project_qkv(w, w.layers[0], torch.nn.functional.embedding(ids, w.embed))
    keys = asm.k[0].clone()
    keys[fresh] = apply_rope(k[fresh], fresh, w.inv_freq, scale=w.rope_scale)
    qpos = query_positions(layout)
    qq = apply_rope(q[qpos], qpos, w.inv_freq, scale=w.rope_scale)
    assert torch.allclose(got, question_attention(qq, keys, qpos), atol=1e-5)
    # Deeper layers add up: two layers score more mass than one.
    two = tiny_oracle.query_attention(ids, layout, asm, num_layers=2)
    assert math.isclose(float(two.sum()), 2 * float(got.sum()), rel_tol=1e-4)
    # The assembled KV is not modified.
    assert torch.equal(asm.k, tiny_oracle.assemble(ids, layout, chunks).k)
