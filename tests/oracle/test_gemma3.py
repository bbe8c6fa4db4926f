"""The oracle on Gemma 3's block, against transformers' ``Gemma3ForCausalLM``, on a tiny
random model built in memory (no download: these always run).

The tiny model exercises every way Gemma 3 differs from the Llama family: a window of 8
over prompts of 40+ tokens, local and global layers with different RoPE tables (the
global one with linear scaling, as Gemma 3 4B+ has), a ``query_pre_attn_scalar`` that
is not the head dim, and norm weights away from zero so that ``1 + w`` is not ``w``.
``tests/oracle/test_gemma3_real.py`` runs the same contracts on Gemma 3 270M.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.fidelity import first_token_kl, oracle_in_dtype
from sgl_pic.layout import PromptLayout, Span
from sgl_pic.oracle import Oracle, weights_from_hf
from sgl_pic.oracle.forward import attention, decode_step
from sgl_pic.selection import make_policy

VOCAB, WINDOW = 97, 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
}


def tiny_gemma3(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A 4-layer Gemma 3 text model with random weights, drawn wider than HF's default
    (peaked attention, well-separated logits) and random norm weights."""
    import transformers

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        rope_parameters=ROPE,
        max_position_embeddings=512,
        initializer_range=0.15,
        pad_token_id=0,
    )
    config = transformers.Gemma3TextConfig(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def gemma() -> SimpleNamespace:
    model = tiny_gemma3()
    return SimpleNamespace(model=model, oracle=Oracle(weights_from_hf(model)))


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0, -1]


def test_weights_record_the_gemma_block(gemma: SimpleNamespace) -> None:
    w, rotary = gemma.oracle.w, gemma.model.model.rotary_emb
    assert w.inv_freq is None  # no one table fits every layer
    assert w.windows == (WINDOW, None, WINDOW, None)
    assert torch.equal(w.rope(0).inv_freq, rotary.sliding_attention_inv_freq)
    assert torch.equal(w.rope(1).inv_freq, rotary.full_attention_inv_freq)
    assert not torch.allclose(w.rope(0).inv_freq, w.rope(1).inv_freq)
    assert w.lm_head.data_ptr() == w.embed.data_ptr()  # tied
    assert w.layers[0].attn_out_norm is not None and w.layers[0].mlp_out_norm is not None


def test_prefill_matches_transformers(gemma: SimpleNamespace) -> None:
    ids = _ids(40)
    with torch.no_grad():
        out = gemma.model(ids[None], use_cache=True)
    full = gemma.oracle.prefill(ids)
    assert torch.allclose(full.logits, out.logits[0, -1], atol=1e-5, rtol=0)
    # HF keeps the last WINDOW - 1 keys of a sliding layer, every key of a global one.
    for li, layer in enumerate(out.past_key_values.layers):
        k, v = layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)
        assert k.shape[0] == (WINDOW - 1 if LAYER_TYPES[li] == "sliding_attention" else 40)
        assert torch.allclose(full.kv.k[li, -k.shape[0] :], k, atol=1e-5), li
        assert torch.allclose(full.kv.v[li, -v.shape[0] :], v, atol=1e-5), li


# Each of Gemma's differences, undone one at a time: the oracle must then disagree with
# transformers, or the tiny model would not test that difference.
UNDONE = {
    "window": {"windows": None},
    "per_layer_rope": {"layer_rope": None},  # every layer with the local table (below)
    "unit_offset_norms": {"unit_offset_norms": False},
    "attn_scale": {"attn_scale": None},
    "gelu": {"mlp_activation": "silu"},
    "embed_scale": {"embed_scale": None},
}


@pytest.mark.parametrize("feature", list(UNDONE))
def test_each_gemma_difference_matters(gemma: SimpleNamespace, feature: str) -> None:
    w = gemma.oracle.w
    change = dict(UNDONE[feature])
    if feature == "per_layer_rope":
        change["inv_freq"] = w.rope(0).inv_freq
    ids = _ids(40)
    wrong = Oracle(dataclasses.replace(w, **change)).prefill(ids).logits
    assert (wrong - _hf_logits(gemma.model, ids)).abs().max() > 1e-2, feature


def test_greedy_decode_past_the_window_matches_transformers(gemma: SimpleNamespace) -> None:
    ids = _ids(30, seed=5)
    full = gemma.oracle.prefill(ids)
    ours = gemma.oracle.generate(full.kv, full.logits, 12)
    with torch.no_grad():
        ref = gemma.model.generate(
            ids[None],
            attention_mask=torch.ones(1, 30, dtype=torch.int64),  # id 0 is not padding here
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, 30:]
    assert torch.equal(ours, ref)


def test_decode_steps_past_the_window_match_transformers(gemma: SimpleNamespace) -> None:
    # Greedy tokens of a tiny tied-embedding model mostly repeat; feeding other tokens
    # makes each step's windowed attention decide its logits.
    w, n, t = gemma.oracle.w, 30, 12
    ids, fed = _ids(n, seed=5), _ids(t, seed=6)
    with torch.no_grad():
        ref = gemma.model(torch.cat([ids, fed])[None]).logits[0, n:]  # [t, vocab]
    full = gemma.oracle.prefill(ids)
    shape = (w.num_layers, 1, n + t, w.num_kv_heads, w.head_dim)
    buf_k, buf_v = torch.zeros(shape), torch.zeros(shape)
    buf_k[:, 0, :n], buf_v[:, 0, :n] = full.kv.k, full.kv.v
    for step in range(t):
        logits = decode_step(w, fed[step : step + 1], n + step, buf_k, buf_v)[0]
        assert torch.allclose(logits, ref[step], atol=1e-5), step


def test_full_recompute_equals_prefill_and_full_reuse_differs(gemma: SimpleNamespace) -> None:
    ids = _ids(60, seed=7)
    layout = PromptLayout.from_lengths([15, 20, 17], fresh_tail=8)
    oracle = gemma.oracle
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    full = oracle.prefill(ids)
    exact = oracle.reuse(ids, layout, chunks, make_policy(PicConfig(policy="full_recompute")))
    assert torch.allclose(exact.logits, full.logits, atol=1e-5)
    assert torch.allclose(exact.kv.k, full.kv.k, atol=1e-5)
    assert torch.allclose(exact.kv.v, full.kv.v, atol=1e-5)
    reused = oracle.reuse(ids, layout, chunks, make_policy(PicConfig(policy="full_reuse")))
    assert first_token_kl(full.logits, reused.logits) > 1e-3


@pytest.mark.parametrize("deferred", [False, True], ids=["rerotated", "deferred_rope"])
def test_moved_chunk_equals_chunk_encoded_there(gemma: SimpleNamespace, deferred: bool) -> None:
    # Attention depends on relative positions only, windows included: a chunk moved from
    # 0 to p has, at every layer, the KV of the chunk encoded at p.
    oracle, ids = gemma.oracle, _ids(20, seed=3)
    at0 = oracle.encode_chunk(ids)
    for p in (5, 300):
        at_p = oracle.encode_chunk(ids, start_position=p)
        prompt = torch.cat([torch.zeros(p, dtype=torch.int64), ids])
        layout = PromptLayout(p + 20, (Span(p, p + 20),))
        moved = oracle.assemble(prompt, layout, [at0], deferred_rope=deferred)
        assert torch.allclose(moved.k[:, p:], at_p.kv.k, atol=1e-5), p
        assert torch.allclose(moved.v[:, p:], at_p.kv.v, atol=1e-5), p


def test_moving_a_global_layers_keys_needs_its_own_table(gemma: SimpleNamespace) -> None:
    oracle, ids, p = gemma.oracle, _ids(20, seed=3), 300
    at0, at_p = oracle.encode_chunk(ids), oracle.encode_chunk(ids, start_position=p)
    old, new = torch.arange(20), torch.arange(p, p + 20)
    assert torch.allclose(oracle.move_keys(1, at0.kv.k[1], old, new), at_p.kv.k[1], atol=1e-5)
    local = Oracle(dataclasses.replace(oracle.w, layer_rope=(oracle.w.rope(0),) * 4))
    wrong = local.move_keys(1, at0.kv.k[1], old, new)
    assert (wrong - at_p.kv.k[1]).abs().max() > 1e-2


def test_windowed_attention_equals_a_dense_masked_softmax(gemma: SimpleNamespace) -> None:
    # More queries than one block (128) and a buffer not starting at 0, so the blocks'
    # key cut (lo, hi) is exercised at their edges.
    w = gemma.oracle.w
    g = torch.Generator().manual_seed(4)
    n, window, start = 300, 37, 11
    q = torch.randn(n, w.num_heads, w.head_dim, generator=g)
    k = torch.randn(n, w.num_kv_heads, w.head_dim, generator=g)
    v = torch.randn(n, w.num_kv_heads, w.head_dim, generator=g)
    pos = torch.arange(start, start + n)
    got = attention(w, q, k, v, pos, pos, window)
    rel = pos[:, None] - pos[None, :]  # [n, n] i - j
    allowed = (rel >= 0) & (rel < window)
    group = w.num_heads // w.num_kv_heads
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
    scores = torch.einsum("ihd,jhd->hij", q, kk) * w.attn_scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("hij,jhd->ihd", probs, vv).reshape(n, -1)
    assert torch.allclose(got, ref, atol=1e-5)


def test_bfloat16_copy_keeps_float32_rope_tables(gemma: SimpleNamespace) -> None:
    low = oracle_in_dtype(gemma.oracle, torch.bfloat16)
    assert low.w.layers[0].attn_out_norm.dtype == torch.bfloat16
    assert all(r.inv_freq.dtype == torch.float32 for r in low.w.layer_rope)
    ids = _ids(40)
    assert first_token_kl(gemma.oracle.prefill(ids).logits, low.prefill(ids).logits) < 0.05


@pytest.mark.parametrize(
    "override, match",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "activation"),
    ],
)
def test_unsupported_configurations_are_rejected(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        weights_from_hf(tiny_gemma3(**override))
