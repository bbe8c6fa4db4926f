"""Shared fixtures: a tiny random Llama for fast exactness checks, the embedded
SmolLM2-135M for checks that need a real model's behaviour, and the one PicMetrics of the
test process.

Tests marked ``sglang`` need SGLang (scripts/install_sglang_cpu.sh). Without it they are
skipped with that reason, unless SGL_PIC_REQUIRE_SGLANG=1 (CI sets it after installing),
where its absence fails the run instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from sgl_pic.oracle import Oracle, load_hf_model, weights_from_hf


def tiny_llama(seed: int = 0, bias: bool = False) -> torch.nn.Module:
    """A 3-layer GQA model with random weights (Qwen2-style q/k/v bias when ``bias``)."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    if bias:
        config = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_oracle(tiny_model: torch.nn.Module) -> Oracle:
    return Oracle(weights_from_hf(tiny_model))


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from sgl_pic.model.embedded import ensure_embedded_model

    return str(ensure_embedded_model().path)


@pytest.fixture(scope="session")
def real_oracle(embedded_path: str) -> Oracle:
    return Oracle(weights_from_hf(load_hf_model(embedded_path)))


@pytest.fixture(scope="session")
def tokenizer(embedded_path: str):  # noqa: ANN201 - a HF tokenizer
    import transformers

    return transformers.AutoTokenizer.from_pretrained(embedded_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("sglang") is not None:
        return
    if os.environ.get("SGL_PIC_REQUIRE_SGLANG") == "1":
        raise pytest.UsageError(
            "SGL_PIC_REQUIRE_SGLANG=1 but sglang is not importable; run "
            "scripts/install_sglang_cpu.sh first"
        )
    skip = pytest.mark.skip(reason="sglang not installed (scripts/install_sglang_cpu.sh)")
    for item in items:
        if "sglang" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def metrics():  # noqa: ANN201 - PicMetrics, imported lazily (it needs prometheus_client)
    """The one PicMetrics of the test process: Prometheus names are global, so a second
    registration in the same process fails. Tests read deltas of it."""
    from sgl_pic.core.metrics import PicMetrics

    return PicMetrics()
