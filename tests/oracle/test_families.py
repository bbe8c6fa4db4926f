"""The oracle on every family the server tests use (tests/support/tiny_models.py):
QKV bias (Qwen2), QK-norm (Qwen3), Mistral, and Llama with Llama 3 and YaRN RoPE scaling.

Each tiny checkpoint is written to disk and read back the way the server reads it; the
oracle's prefill must equal transformers' own forward (logits and every layer's KV),
and its RoPE formulas must equal HF's and SGLang's. The last tests check that the tiny
models are fit for the server comparisons: distinct greedy tokens with clear margins,
and reuse that measurably changes the logits.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_pic.fidelity import first_token_kl
from sgl_pic.layout import PromptLayout
from sgl_pic.oracle import Oracle, load_hf_model, weights_from_hf
from sgl_pic.oracle.rope_scaling import rope_frequencies
from sgl_pic.rope import default_inv_freq
from sgl_pic.selection import make_policy
from tests.support.tiny_models import FAMILIES, LLAMA3_ROPE, YARN_ROPE, write_tiny_model

N_TOKENS = 90


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, embedded_path: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {f: write_tiny_model(f, root / f, embedded_path).path for f in FAMILIES}


@pytest.fixture(scope="session", params=FAMILIES)
def family(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> SimpleNamespace:
    model = load_hf_model(tiny_dirs[request.param])
    return SimpleNamespace(name=request.param, model=model, oracle=Oracle(weights_from_hf(model)))


def _ids(vocab: int, n: int = N_TOKENS, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_checkpoint_has_the_family_feature(family: SimpleNamespace) -> None:
    # Each family must exercise what it stands for, or the server test proves nothing.
    w, cfg = family.oracle.w, family.model.config
    layer = w.layers[0]
    plain = default_inv_freq(w.head_dim, float(cfg.rope_parameters["rope_theta"]))
    scaled = not torch.allclose(w.inv_freq, plain, rtol=1e-5)
    expected = {
        "qwen2": (layer.q_bias is not None, layer.q_norm is None, not scaled),
        "qwen3": (layer.q_norm is not None, layer.q_bias is None, not scaled),
        "mistral": (cfg.model_type == "mistral", layer.q_bias is None, not scaled),
        "llama_scaled": (scaled, w.rope_scale == 1.0, layer.q_bias is None),
        "llama_yarn": (scaled, w.rope_scale > 1.0, layer.q_bias is None),
    }[family.name]
    assert all(expected), expected


def test_prefill_matches_transformers(family: SimpleNamespace) -> None:
    ids = _ids(family.model.config.vocab_size)
    with torch.no_grad():
        out = family.model(ids[None], use_cache=True)
    full = family.oracle.prefill(ids)
    assert torch.allclose(full.logits, out.logits[0, -1], atol=1e-4, rtol=0)
    # Every layer's post-RoPE keys and values, as HF caches them # [1, Hkv, N, D].
    for li, layer in enumerate(out.past_key_values.layers):
        assert torch.allclose(full.kv.k[li], layer.keys[0].transpose(0, 1), atol=1e-4), li
        assert torch.allclose(full.kv.v[li], layer.values[0].transpose(0, 1), atol=1e-4), li


def test_greedy_decode_matches_transformers(family: SimpleNamespace) -> None:
    ids = _ids(family.model.config.vocab_size, n=40, seed=5)
    full = family.oracle.prefill(ids)
    ours = family.oracle.generate(full.kv, full.logits, 8)
    with torch.no_grad():
        ref = family.model.generate(
            ids[None], max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=2
        )[0, 40:]
    assert torch.equal(ours, ref)


def test_full_recompute_equals_prefill(family: SimpleNamespace) -> None:
    ids = _ids(family.model.config.vocab_size, seed=7)
    layout = PromptLayout.from_lengths([30, 25, 20], fresh_tail=15)
    oracle = family.oracle
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    res = oracle.reuse(ids, layout, chunks, make_policy(_config("full_recompute")))
    full = oracle.prefill(ids)
    assert torch.allclose(res.logits, full.logits, atol=1e-4)
    assert torch.allclose(res.kv.k, full.kv.k, atol=1e-4)


def test_tiny_model_is_fit_for_server_comparisons(family: SimpleNamespace) -> None:
    """Greedy tokens vary and are not near-ties, and reuse changes the logits: otherwise
    'equals vanilla' and 'matches the oracle' would hold for the wrong reasons."""
    vocab = family.model.config.vocab_size
    ids = _ids(vocab, seed=11)
    with torch.no_grad():
        logits = family.model(ids[None]).logits[0]  # [N, vocab]
    top = logits.topk(2, dim=-1)
    assert top.indices[:, 0].unique().numel() >= N_TOKENS // 2
    assert float((top.values[:, 0] - top.values[:, 1]).median()) > 0.1
    oracle = family.oracle
    layout = PromptLayout.from_lengths([30, 25, 20], fresh_tail=15)
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    reused = oracle.reuse(ids, layout, chunks, make_policy(_config("full_reuse")))
    assert first_token_kl(oracle.prefill(ids).logits, reused.logits) > 1e-3


def _config(policy: str):  # noqa: ANN202 - a PicConfig
    from sgl_pic.config import PicConfig

    return PicConfig(policy=policy)


# -- RoPE formulas against HF and SGLang ----------------------------------------------------


def _cfg(rope: dict | None, max_pos: int = 4096, head_dim: int = 16) -> SimpleNamespace:
    params = {"rope_type": "default", "rope_theta": 10000.0, **(rope or {})}
    return SimpleNamespace(
        rope_parameters=params,
        head_dim=head_dim,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
    )


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": LLAMA3_ROPE,
    "yarn": YARN_ROPE,
    "yarn_mscale": {**YARN_ROPE, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_frequencies_equal_transformers(name: str) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = ROPES[name]
    ours = rope_frequencies(_cfg(rope, head_dim=32))
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope or {})},
    )
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        inv, scale = ref.inv_freq, ref.attention_scaling
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    assert torch.equal(ours.inv_freq, inv.to(torch.float32)), name
    assert math.isclose(ours.attention_scaling, float(scale), rel_tol=1e-12), name


# Run where SGLang serves: its CPU platform is chosen at import from the environment
# that ``activate_cpu_stubs`` sets, so it gets a process of its own.
_SGLANG_CACHES = """
import json, sys
from sgl_pic.binding.cpu_env import activate_cpu_stubs
activate_cpu_stubs()
import torch
from sglang.srt.layers.rotary_embedding import get_rope
out = {}
for name, rope in json.loads(sys.argv[1]).items():
    r = get_rope(16, rotary_dim=16, max_position=4096, base=10000.0, rope_scaling=rope,
                 dtype=torch.float32)
    out[name] = r.cos_sin_cache[:1024].to(torch.float32).tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sglang_cos_sin() -> dict[str, torch.Tensor]:
    """SGLang's cos/sin cache # [1024, cos | sin] of each of ``ROPES``, built by its own
    ``get_rope`` as its models do."""
    import json
    import subprocess
    import sys

    pytest.importorskip("sglang")
    proc = subprocess.run(
        [sys.executable, "-c", _SGLANG_CACHES, json.dumps(ROPES)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {k: torch.tensor(v) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_frequencies_equal_sglang_cos_sin_cache(
    name: str, sglang_cos_sin: dict[str, torch.Tensor]
) -> None:
    ours = rope_frequencies(_cfg(ROPES[name]))
    angles = torch.arange(1024, dtype=torch.float32)[:, None] * ours.inv_freq[None, :]
    expect = torch.cat([angles.cos(), angles.sin()], dim=-1) * ours.attention_scaling
    assert torch.allclose(sglang_cos_sin[name], expect, atol=1e-5, rtol=0), name


def test_position_dependent_rope_is_rejected() -> None:
    with pytest.raises(NotImplementedError, match="dynamic"):
        rope_frequencies(_cfg({"rope_type": "dynamic", "factor": 2.0}))


def test_v4_style_rope_scaling_is_read() -> None:
    # Older configs: rope_theta at top level, scaling in rope_scaling with "type".
    old = SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        head_dim=16,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=4096,
    )
    expect = default_inv_freq(16, 10000.0) / 4.0
    assert torch.allclose(rope_frequencies(old).inv_freq, expect, rtol=1e-6, atol=0)
