"""The start-up support check and the decoder-stack wrapper, on stand-ins: covered
backends and models pass, everything the method does not cover is refused with a reason,
and the wrapper hands extend batches to the executor and nothing else."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_pic.binding.model_hooks import SUPPORTED_BACKENDS, check_support, install

# check_support reads arguments through SGLang's resolved_view.
pytestmark = pytest.mark.sglang


class MHATokenToKVPool:  # the class name is what the check reads
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype


class RadixAttention(torch.nn.Module):
    def __init__(self, sliding_window_size: int = -1, cross: bool = False) -> None:
        super().__init__()
        self.sliding_window_size = sliding_window_size
        self.is_cross_attention = cross


class RotaryEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary_dim, self.head_size, self.is_neox_style = 8, 8, True
        self.register_buffer("cos_sin_cache", torch.ones(16, 8), persistent=False)


class Layer(torch.nn.Module):
    def __init__(self, **attn: Any) -> None:
        super().__init__()
        self.attn = RadixAttention(**attn)
        self.rotary_emb = RotaryEmbedding()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Stack(torch.nn.Module):
    def __init__(self, **attn: Any) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(**attn), Layer(**attn)])

    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        fb: Any,
        input_embeds: torch.Tensor | None = None,  # [n], as SGLang's stacks take it
    ) -> torch.Tensor:
        h = input_ids.float()
        for layer in self.layers:
            h = layer(h)
        return h


class Model(torch.nn.Module):
    def __init__(self, **attn: Any) -> None:
        super().__init__()
        self.model = Stack(**attn)


def ctx(backend: str = "flashinfer", model: Any = None, pool: Any = None, **over: Any) -> Any:
    args = SimpleNamespace(
        attention_backend=backend,
        prefill_attention_backend=None,
        pp_size=1,
        enable_dp_attention=False,
        speculative_algorithm=None,
    )
    for k, v in over.items():
        setattr(args, k, v)
    runner = SimpleNamespace(model=model or Model(), prefill_cuda_graph_runner=None)
    return SimpleNamespace(
        server_args=args,
        tp_worker=SimpleNamespace(model_runner=runner),
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        is_dsa=False,
        model_config=SimpleNamespace(hf_config=SimpleNamespace()),
        params=SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(
                get_kvcache=lambda: pool or MHATokenToKVPool()
            )
        ),
    )


@pytest.mark.parametrize("backend", sorted(SUPPORTED_BACKENDS))
def test_covered_backends_pass(backend: str) -> None:
    assert check_support(ctx(backend)).ok


@pytest.mark.parametrize(
    ("c", "reason"),
    [
        (ctx("fa4"), "backend"),
        (ctx(speculative_algorithm="EAGLE"), "speculative"),
        (ctx(pp_size=2), "parallelism"),
        (ctx(enable_dp_attention=True), "parallelism"),
        (ctx(pool=MHATokenToKVPool(torch.float8_e4m3fn)), "kv_dtype"),
        (ctx(model=Model(sliding_window_size=4096)), "sliding_window"),
        (ctx(model=Model(cross=True)), "cross_attention"),
        (ctx(model=torch.nn.Linear(2, 2)), "model"),
        (ctx(enable_lora=True), "lora"),
        (ctx(enable_hierarchical_cache=True), "kv_tiers"),
        (ctx(enable_lmcache=True), "kv_tiers"),
        (ctx(enable_flexkv=True), "kv_tiers"),
        (ctx(enable_unified_cache_external_linker=True), "kv_tiers"),
        (ctx(disaggregation_decode_retraction_backup="host_pool"), "kv_tiers"),
        (ctx(disaggregation_mode="prefill"), "disaggregation"),
        (ctx(disaggregation_mode="decode"), "disaggregation"),
    ],
)
def test_uncovered_servers_are_refused_with_a_reason(c: Any, reason: str) -> None:
    support = check_support(c)
    assert not support.ok and support.reason == reason and support.detail
    # Every refusal says what lifts it: a flag, or that the model itself is not covered.
    assert re.search(r"lifted by (dropping )?--|no server flag lifts it", support.detail)


def test_a_guarded_prefill_graph_runner_is_served_and_an_unguarded_one_refused() -> None:
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )

    c = ctx()
    c.tp_worker.model_runner.prefill_cuda_graph_runner = object.__new__(PrefillCudaGraphRunner)
    assert check_support(c, lambda _r: True).ok
    support = check_support(c, lambda _r: False)
    assert support.reason == "prefill_graph"
    assert "--cuda-graph-backend-prefill disabled" in support.detail


def test_sglang_defaults_for_tiers_and_disaggregation_pass() -> None:
    plain = ctx(
        enable_hierarchical_cache=False,
        enable_lmcache=False,
        disaggregation_decode_retraction_backup=None,
        disaggregation_mode="null",
    )
    assert check_support(plain).ok


def test_hybrid_mla_and_other_pools_are_refused() -> None:
    c = ctx()
    c.is_hybrid_ssm = True
    assert check_support(c).reason == "hybrid"
    c = ctx()
    c.model_config.hf_config.kv_lora_rank = 512
    assert check_support(c).reason == "mla"
    assert check_support(ctx(pool=SimpleNamespace(dtype=torch.float32))).reason == "kv_pool"
    c = ctx()
    c.tp_worker.model_runner.prefill_cuda_graph_runner = SimpleNamespace()
    assert check_support(c).reason == "prefill_graph"


def test_the_model_part_is_the_launchers_config_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_pic.binding import model_hooks
    from sgl_pic.binding.self_check import Support, check_model_config

    c = ctx()
    c.is_dsa = True  # the build context's own flags count as the config's
    assert check_support(c) == check_model_config(c.model_config, hybrid=True)
    assert check_support(c).reason == "hybrid"
    # A model refusal comes before a backend's: no flag would lift it.
    c = ctx("trtllm_mha")
    c.model_config.hf_config.kv_lora_rank = 512
    assert check_support(c).reason == "mla"
    c = ctx()
    c.model_config.is_encoder_decoder = True
    assert check_support(c).reason == "cross_attention"
    seen: list[tuple[Any, bool]] = []

    def spy(model_config: Any, hybrid: bool = False) -> Support:
        seen.append((model_config, hybrid))
        return Support("spy", "lifted by --spy")

    monkeypatch.setattr(model_hooks, "check_model_config", spy)
    c = ctx()
    assert check_support(c) == ("spy", "lifted by --spy") and seen == [(c.model_config, False)]


def test_wrapper_hands_extend_batches_to_the_executor_only() -> None:
    model = Model()
    seen: list[Any] = []
    layers: list[tuple[str, int]] = []

    def on_extend(stack: Any, ids: torch.Tensor, pos: torch.Tensor, fb: Any) -> Any:
        seen.append(fb)
        if fb.chunked:
            return stack(ids, pos, fb) * 10  # the stack's own forward is reachable
        return None

    runner = SimpleNamespace(model=model)
    bypassed: list[Any] = []
    install(
        runner,
        on_extend,
        lambda i: layers.append(("pre", i)),
        lambda i: layers.append(("post", i)),
        bypassed.append,
    )
    attributes = set(vars(model.model))
    install(runner, on_extend, print, print)  # idempotent: one wrapper, one set of hooks
    # Nothing of ours on the stack but the wrapper set as its forward.
    assert set(vars(model.model)) == attributes
    assert not [k for k in attributes if k.startswith("_sgl_pic")]
    extend = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), chunked=True)
    plain = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), chunked=False)
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False), chunked=True)
    ids, pos = torch.tensor([1, 2]), torch.tensor([0, 1])
    assert model.model(ids, pos, extend).tolist() == [30.0, 40.0]
    assert model.model(ids, pos, plain).tolist() == [3.0, 4.0]  # None: the stack ran it
    assert model.model(ids, pos, decode).tolist() == [3.0, 4.0]
    assert seen == [extend, plain]  # decode never reaches the executor
    # Input embeddings: the executor cannot take the batch; it is reported, then run.
    assert model.model(ids, pos, extend, torch.zeros(2)).tolist() == [3.0, 4.0]
    assert bypassed == [extend] and seen == [extend, plain]
    assert layers[:4] == [("pre", 0), ("post", 0), ("pre", 1), ("post", 1)]
    assert len(layers) == 4 * 4  # four forwards, each layer hooked once
