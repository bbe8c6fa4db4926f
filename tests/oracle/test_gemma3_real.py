"""The oracle on Gemma 3 270M, the second real model, against transformers' own forward.

Needs the opt-in install (``bash scripts/install_gemma3.sh``); skips naming it otherwise.
The long prompt is longer than the model's sliding window (512), so its local layers'
window decides the logits: an oracle ignoring it is shown to fail.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.fidelity import first_token_kl
from sgl_pic.layout import PromptLayout, Span
from sgl_pic.model import gemma3
from sgl_pic.oracle import FullPrefill, Oracle, load_hf_model, weights_from_hf
from sgl_pic.selection import make_policy

LONG = 720  # tokens; > the sliding window
LAYOUT = PromptLayout.from_lengths([250, 250, 150], fresh_tail=LONG - 650)


@pytest.fixture(scope="module")
def real() -> SimpleNamespace:
    path = gemma3.installed_path()
    if path is None:
        pytest.skip(f"Gemma 3 270M is not installed: run `{gemma3.INSTALL}`")
    model = load_hf_model(path)
    # Ordinary text-token ids (special and image tokens are below 1000 or unused).
    ids = torch.randint(1000, 200_000, (LONG,), generator=torch.Generator().manual_seed(0))
    return SimpleNamespace(path=path, model=model, oracle=Oracle(weights_from_hf(model)), ids=ids)


@pytest.fixture(scope="module")
def full(real: SimpleNamespace) -> FullPrefill:
    return real.oracle.prefill(real.ids)


def test_the_prompt_outgrows_the_sliding_window(real: SimpleNamespace) -> None:
    w = real.oracle.w
    windows = {w.window(li) for li in range(w.num_layers)}
    assert None in windows and max(x for x in windows if x is not None) < LONG


def test_prefill_matches_transformers_past_the_window(
    real: SimpleNamespace, full: FullPrefill
) -> None:
    with torch.no_grad():
        out = real.model(real.ids[None], logits_to_keep=1, use_cache=True)
    ref = out.logits[0, -1]
    assert torch.allclose(full.logits, ref, atol=5e-4, rtol=0)
    # The first local and the first global layer's KV, as HF caches them (a local layer
    # keeps its last window - 1 positions).
    for li in (0, 5):
        layer = out.past_key_values.layers[li]
        k, v = layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)
        assert torch.allclose(full.kv.k[li, -k.shape[0] :], k, atol=2e-3), li
        assert torch.allclose(full.kv.v[li, -v.shape[0] :], v, atol=2e-3), li
    blind = Oracle(dataclasses.replace(real.oracle.w, windows=None)).prefill(real.ids)
    assert (blind.logits - ref).abs().max() > 1.0


def test_greedy_decode_matches_transformers(real: SimpleNamespace, full: FullPrefill) -> None:
    ours = real.oracle.generate(full.kv, full.logits, 6)
    with torch.no_grad():
        ref = real.model.generate(
            real.ids[None],
            attention_mask=torch.ones(1, LONG, dtype=torch.int64),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
        )[0, LONG:]
    assert torch.equal(ours, ref)


def test_rerotation_is_exact_on_local_and_global_layers(real: SimpleNamespace) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(real.path)
    text = "The Punica is a Latin epic poem in seventeen books written by Silius Italicus."
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    n, oracle, w = ids.numel(), real.oracle, real.oracle.w
    local, glob = 0, next(li for li in range(w.num_layers) if w.window(li) is None)
    at0 = oracle.encode_chunk(ids)
    for p in (17, 3000):
        at_p = oracle.encode_chunk(ids, start_position=p)
        old, new = torch.arange(n), torch.arange(p, p + n)
        # Layer 0's keys depend on the token alone: only the rotation can differ.
        assert torch.allclose(
            oracle.move_keys(local, at0.kv.k[0], old, new), at_p.kv.k[0], atol=1e-5
        )
        moved = oracle.move_keys(glob, at0.kv.k[glob], old, new)
        assert torch.allclose(moved, at_p.kv.k[glob], atol=5e-4), p
        # With the other kind of layer's table the keys land elsewhere.
        wrong = oracle.move_keys(local, at0.kv.k[glob], old, new)
        assert (wrong - at_p.kv.k[glob]).abs().max() > 1.0, p
        # Every layer, through assembly as reuse does it.
        prompt = torch.cat([torch.zeros(p, dtype=torch.int64), ids])
        asm = oracle.assemble(prompt, PromptLayout(p + n, (Span(p, p + n),)), [at0])
        err = (asm.k[:, p:] - at_p.kv.k).abs().max() / at_p.kv.k.abs().max()
        assert err < 1e-5, p
        assert torch.allclose(asm.v[:, p:], at_p.kv.v, atol=5e-4), p


def test_full_recompute_through_reuse_equals_prefill(
    real: SimpleNamespace, full: FullPrefill
) -> None:
    oracle, ids = real.oracle, real.ids
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in LAYOUT.chunks]
    exact = oracle.reuse(ids, LAYOUT, chunks, make_policy(PicConfig(policy="full_recompute")))
    assert torch.allclose(exact.logits, full.logits, atol=1e-4)
    assert torch.allclose(exact.kv.k, full.kv.k, atol=1e-4)
    assert torch.allclose(exact.kv.v, full.kv.v, atol=1e-4)
    reused = oracle.reuse(ids, LAYOUT, chunks, make_policy(PicConfig(policy="full_reuse")))
    assert first_token_kl(full.logits, reused.logits) > 1e-3
