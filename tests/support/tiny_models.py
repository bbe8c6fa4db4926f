"""Tiny random-weight checkpoints of the decoder families sgl_pic serves, made at test time.

Each is a complete HF directory (config.json, model.safetensors, the embedded model's
tokenizer) that transformers, the oracle and SGLang all load, so one prompt's token ids
mean the same thing to each of them. The vocabulary is the embedded SmolLM2's, so the
prompts of ``tests.support.prompts`` apply unchanged.

Weights are seeded and drawn wider than HF's default initializer (std 0.02): with it the
attention is nearly uniform (positions, hence reuse, barely matter) and the logits nearly
tied (greedy tokens would flip on rounding noise). ``WEIGHT_STD`` gives peaked attention
and well-separated logits; ``tests/oracle/test_families.py`` checks both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

FAMILIES: tuple[str, ...] = ("qwen2", "qwen3", "mistral", "llama_scaled", "llama_yarn")

WEIGHT_STD = 0.15  # every projection and the embedding (see the docstring)
LM_HEAD_STD = 0.5  # logits about 4 apart in std: greedy margins far above rounding noise
SEED = 1234
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# Llama 3 scaling with a short original context, so that it changes most frequencies of a
# 16-dim head at the positions of a test prompt (with 8192, only the slowest ones).
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
# YaRN: blended frequencies and an attention scale (mscale = 0.1 ln 4 + 1) on cos and sin.
YARN_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
}


class TinyModel(NamedTuple):
    family: str
    path: Path
    architecture: str  # the HF / SGLang model class


def _config(family: str, vocab_size: int) -> Any:
    import transformers

    kw = dict(_COMMON, vocab_size=vocab_size)
    if family == "qwen2":
        # Qwen2 always has q/k/v biases; its head dim is hidden / heads (16 here too).
        kw.pop("head_dim")
        return transformers.Qwen2Config(**kw, rope_parameters={"rope_theta": 1e6})
    if family == "qwen3":
        return transformers.Qwen3Config(**kw, rope_parameters={"rope_theta": 1e6})
    if family == "mistral":
        return transformers.MistralConfig(**kw, sliding_window=None)
    if family == "llama_scaled":
        return transformers.LlamaConfig(**kw, rope_parameters=dict(LLAMA3_ROPE))
    if family == "llama_yarn":
        kw["max_position_embeddings"] = int(YARN_ROPE["factor"]) * int(
            YARN_ROPE["original_max_position_embeddings"]
        )
        return transformers.LlamaConfig(**kw, rope_parameters=dict(YARN_ROPE))
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def build_model(family: str, vocab_size: int, seed: int = SEED) -> torch.nn.Module:
    """The random float32 ``*ForCausalLM`` of ``family`` in eval mode (nothing written)."""
    import transformers

    config = _config(family, vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # RMSNorm gains near 1 (not exactly, so a norm applied twice or skipped shows).
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.startswith("lm_head"):
                p.copy_(LM_HEAD_STD * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(WEIGHT_STD * torch.randn(p.shape, generator=gen))
    return model.to(torch.float32).eval()


def write_tiny_model(family: str, directory: str | Path, tokenizer_dir: str | Path) -> TinyModel:
    """Write the tiny ``family`` checkpoint into ``directory`` (created if missing) with the
    tokenizer files of ``tokenizer_dir``; same seed, same bytes."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Path(tokenizer_dir)
    vocab_size = int(json.loads((tok / "config.json").read_text())["vocab_size"])
    model = build_model(family, vocab_size)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copy2(tok / name, out / name)
    return TinyModel(family, out, type(model).__name__)


def write_all(root: str | Path, tokenizer_dir: str | Path) -> dict[str, TinyModel]:
    """Every family under ``root/<family>``."""
    return {f: write_tiny_model(f, Path(root) / f, tokenizer_dir) for f in FAMILIES}
