"""The support check on SGLang's resolved arguments: resolved values are read (not the raw
record), every prefill graph backend is served, page sizes must agree, and every refusal
names the flag that lifts it; the model's config is refused by what SGLang's ModelConfig
says of it. (A whole launch on a mocked CUDA GPU: ``tests/cli/test_launch_server.py``.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pic.binding.self_check import (
    check_args,
    check_launch,
    check_model_config,
    check_page_size,
)

# The checks read arguments through SGLang's resolved_view.
pytestmark = pytest.mark.sglang


def resolved_args(**declared: Any) -> Any:
    """A record as SGLang's resolution leaves it: raw fields unset (``None``), the
    decisions in ``_resolved_overrides`` (``overrides.declare_resolution``'s stash)."""
    raw = SimpleNamespace(attention_backend=None, page_size=None, cuda_graph_config=None)
    raw._resolved_overrides = [("_resolution", declared)]
    return raw


def test_checks_read_the_resolved_arguments_not_the_raw_record() -> None:
    # A default launch leaves attention_backend None on the record itself.
    support = check_args(resolved_args(attention_backend="trtllm_mha"))
    assert support.reason == "backend" and "--attention-backend" in support.detail
    assert check_args(resolved_args(attention_backend="fa3")).ok
    support = check_args(resolved_args(attention_backend="fa3", decode_attention_backend="fa4"))
    assert support.reason == "backend" and "--decode-attention-backend" in support.detail
    support = check_args(resolved_args(attention_backend="fa3", kv_cache_dtype="fp8_e4m3"))
    assert support.reason == "kv_dtype" and "--kv-cache-dtype auto" in support.detail


@pytest.mark.parametrize("dtype", ["auto", "bf16", "bfloat16", "float16", "float32"])
def test_every_unquantized_kv_cache_dtype_of_sglang_is_served(dtype: str) -> None:
    # SGLang maps "bf16" and "bfloat16" alike to a bfloat16 pool (kv_cache_dtype.py).
    assert check_args(resolved_args(attention_backend="fa3", kv_cache_dtype=dtype)).ok


def test_pd_multiplexing_is_refused_naming_its_flag() -> None:
    # Its split prefill walks the layers itself and never calls the wrapped stack.
    support = check_args(resolved_args(attention_backend="fa3", enable_pdmux=True))
    assert support.reason == "parallelism" and "--enable-pdmux" in support.detail


@pytest.mark.parametrize("backend", ["disabled", "breakable", "full"])
def test_every_prefill_graph_backend_of_sglang_is_served(backend: str) -> None:
    graphs = SimpleNamespace(prefill=SimpleNamespace(backend=backend))
    assert check_args(resolved_args(attention_backend="flashinfer", cuda_graph_config=graphs)).ok


def test_the_launch_page_size_must_be_the_resolved_one() -> None:
    args = resolved_args(attention_backend="flashinfer", page_size=64)
    support = check_launch(args, 1)
    assert support.reason == "page_size" and "--page-size 64" in support.detail
    assert check_launch(args, 64).ok


@pytest.mark.sglang
def test_the_pool_page_size_must_be_the_padded_one() -> None:
    # SGLang's own pool and paged allocator, on the CPU.
    import torch

    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(64, 16, torch.float32, 2, 8, 2, "cpu", False)
    allocator = PagedTokenToKVPoolAllocator(64, 16, torch.float32, "cpu", pool, False)
    ctx = SimpleNamespace(
        params=SimpleNamespace(token_to_kv_pool_allocator=allocator, page_size=16)
    )
    support = check_page_size(1, ctx)
    assert support.reason == "page_size" and "--page-size 16" in support.detail
    assert check_page_size(16, ctx).ok


# --- MoE expert parallelism, diffusion LMs and DP attention, on SGLang's own ServerArgs ---


def cli_args(*argv: str) -> Any:
    """SGLang's ServerArgs as its own command-line parser and ``from_cli_args`` make them
    from ``argv`` (not resolved)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "unused", "--device", "cpu", *argv])
    )


def test_sglang_defaults_and_tp_only_moe_are_served() -> None:
    # TP-only MoE: SGLang sets no non-padded token count, so its top-k masks nothing.
    assert check_args(cli_args()).ok
    assert check_args(cli_args("--tp-size", "4", "--moe-runner-backend", "triton")).ok


@pytest.mark.parametrize(
    ("argv", "lift", "lift_argv"),
    [
        (["--ep-size", "2"], "--ep-size 1", ["--ep-size", "1"]),
        (["--ep", "2"], "--ep-size 1", ["--ep-size", "1"]),
        (["--moe-a2a-backend", "deepep"], "--moe-a2a-backend none", ["--moe-a2a-backend", "none"]),
        (["--moe-a2a-backend", "mori"], "--moe-a2a-backend none", ["--moe-a2a-backend", "none"]),
        (["--enable-waterfill"], "dropping --enable-waterfill", None),
        (["--elastic-ep-backend", "mooncake"], "dropping --elastic-ep-backend", None),
        (["--elastic-ep-join-mode", "scale"], "dropping --elastic-ep-join-mode", None),
    ],
)
def test_expert_parallelism_is_refused_naming_the_flag_that_lifts_it(
    argv: list[str], lift: str, lift_argv: list[str] | None
) -> None:
    support = check_args(cli_args(*argv))
    assert support.reason == "expert_parallel" and f"lifted by {lift}" in support.detail
    # The flag named lifts it: set as named (argparse keeps the last), or dropped.
    lifted = cli_args(*argv, *lift_argv) if lift_argv is not None else cli_args()
    assert check_args(lifted).ok


def test_expert_parallelism_is_read_as_sglang_resolves_it() -> None:
    # SGLang's own passes: an all-to-all backend widens EP to the TP size on the
    # resolved view, and Waterfill turns into the DeepEP backend; the raw record keeps
    # ep_size 1 and moe_a2a_backend "none".
    from sglang.srt.arg_groups.overrides import (
        _a2a_backend_overrides,
        _a2a_ep_size,
        run_post_process_pass,
    )

    for argv in (["--moe-a2a-backend", "deepep"], ["--enable-waterfill"]):
        args = cli_args("--tp-size", "4", *argv)
        for sglang_pass in (_a2a_backend_overrides, _a2a_ep_size):
            run_post_process_pass(args, sglang_pass)
        assert args.ep_size == 1
        support = check_args(args)
        assert support.reason == "expert_parallel"
        assert "--moe-a2a-backend none (not deepep)" in support.detail
        assert "--ep-size 1" in support.detail
    plain = cli_args("--tp-size", "4")
    for sglang_pass in (_a2a_backend_overrides, _a2a_ep_size):
        run_post_process_pass(plain, sglang_pass)
    assert check_args(plain).ok


def test_diffusion_lms_are_refused_naming_their_flag() -> None:
    support = check_args(cli_args("--dllm-algorithm", "LowConfidence"))
    assert support.reason == "dllm" and "lifted by dropping --dllm-algorithm" in support.detail
    assert (
        check_args(resolved_args(attention_backend="fa3", dllm_algorithm="LowConfidence")).reason
        == "dllm"
    )


def test_dp_attention_is_refused_as_sglang_resolves_it() -> None:
    # SGLang 0.5.23 resolves --dp-size N --enable-dp-attention into attn_dp_size N and
    # leaves enable_dp_attention false on the resolved view.
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention

    args = cli_args("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    handle_deprecated_dp_attention(args)
    assert not resolved_view(args).enable_dp_attention
    for refused in (args, cli_args("--attn-dp-size", "2"), cli_args("--dwdp-size", "2")):
        support = check_args(refused)
        assert support.reason == "parallelism" and "--attn-dp-size 1" in support.detail


# The ServerArgs fields the checks above read, and the flags their refusals name.
CHECKED_FLAGS = {
    "ep_size": ["--ep-size", "2"],
    "moe_a2a_backend": ["--moe-a2a-backend", "deepep"],
    "enable_waterfill": ["--enable-waterfill"],
    "elastic_ep_backend": ["--elastic-ep-backend", "mooncake"],
    "ep_join_mode": ["--elastic-ep-join-mode", "scale"],
    "dllm_algorithm": ["--dllm-algorithm", "LowConfidence"],
    "attn_dp_size": ["--attn-dp-size", "2"],
    "dwdp_size": ["--dwdp-size", "2"],
    "enable_dp_attention": ["--enable-dp-attention"],
}


def test_the_checked_fields_and_flags_exist_in_sglang() -> None:
    # A rename in SGLang fails here rather than silently serving with reuse on.
    import msgspec
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
    assert set(CHECKED_FLAGS) <= fields
    default = cli_args()
    for field, argv in CHECKED_FLAGS.items():
        assert getattr(cli_args(*argv), field) != getattr(default, field), argv


def function_source(module: str, name: str) -> str:
    """The source text of top-level function ``name`` in SGLang's ``module``, read from
    its file under the installed ``sglang`` package (the module is not imported)."""
    import ast
    from pathlib import Path

    import sglang

    root = Path(sglang.__file__).parent.parent
    text = (root / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{module}.{name} is gone")


def test_sglang_masks_moe_rows_only_under_the_refused_settings() -> None:
    # Top-k reads the row bound from the forward context, which a phase batch inherits
    # from the live batch ...
    routing = function_source("sglang.srt.layers.moe.topk", "resolve_routing_inputs")
    assert "get_forward_context().moe_num_token_non_padded" in routing
    # ... and SGLang sets that bound only under EP, the (customized) all-to-all backend,
    # elastic EP's WORLD gather, or DP attention with TP MoE on ROCm: all refused.
    gate = function_source(
        "sglang.srt.model_executor.forward_batch_info", "enable_num_token_non_padded"
    )
    for condition in (
        "get_parallel().moe_ep_size > 1",
        "world_dp_gather_enabled()",
        "get_moe_a2a_backend().is_customized()",
        "_dp_tp_moe_masks_pad_rows()",
    ):
        assert condition in gate
    assert gate.count(" or ") == 2, "SGLang masks MoE rows under a new condition"
    rocm = function_source(
        "sglang.srt.model_executor.forward_batch_info", "_dp_tp_moe_masks_pad_rows"
    )
    assert "get_parallel().attn_dp_size > 1" in rocm
    widths = function_source("sglang.srt.runtime_context", "parallel_widths_of")
    assert "moe_ep_size=cfg.ep_size" in widths


# --- The model's config, as SGLang's ModelConfig reads it before the model loads ---

# Small configs of architectures SGLang serves with multi-head latent attention, with
# DeepSeek sparse attention (DSA: a DeepSeek-V3 architecture with an indexer) and with
# hybrid linear (gated delta-net) attention; ModelConfig reads config.json alone.
SHAPES = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=1000,
    max_position_embeddings=2048,
    num_experts_per_tok=2,
    torch_dtype="bfloat16",
)
MLA = dict(
    SHAPES,
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
)
DSA = dict(
    MLA,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    q_lora_rank=32,
    index_topk=16,
    index_head_dim=32,
    index_n_heads=2,
)
HYBRID_SSM = dict(
    SHAPES,
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    full_attention_interval=4,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    shared_expert_intermediate_size=32,
)


def sglang_model_config(path: Any, **kwargs: Any) -> Any:
    """SGLang's ModelConfig of the model directory ``path`` (on the CPU)."""
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_path=str(path), **kwargs)


def config_dir(path: Any, config: dict) -> Any:
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_model_config_check_refuses_hybrid_and_mla_models_as_sglang_reads_them(
    tmp_path: Any, embedded_path: str
) -> None:
    from tests.support.cuda_args import write_hybrid_swa_model

    assert check_model_config(sglang_model_config(embedded_path)).ok
    gpt_oss = write_hybrid_swa_model(tmp_path / "gpt-oss")
    for disabled in (False, True):
        # --disable-hybrid-swa-memory gives GPT-OSS SGLang's plain pool; its sliding
        # layers keep their window, so it stays refused.
        config = sglang_model_config(gpt_oss, disable_hybrid_swa_memory=disabled)
        assert config.is_hybrid_swa is not disabled
        assert check_model_config(config).reason == "hybrid"
    mla = sglang_model_config(config_dir(tmp_path / "mla", MLA))
    assert mla.attention_arch.name == "MLA" and check_model_config(mla).reason == "mla"
    # SGLang's scheduler marks these is_dsa / is_hybrid_ssm (kv_cache_builder).
    for name, config in (("dsa", DSA), ("ssm", HYBRID_SSM)):
        support = check_model_config(sglang_model_config(config_dir(tmp_path / name, config)))
        assert support.reason == "hybrid" and "no server flag lifts it" in support.detail


def test_the_model_config_check_reads_a_stand_in_by_its_fields() -> None:
    assert check_model_config(SimpleNamespace(hf_config=SimpleNamespace())).ok
    mla = SimpleNamespace(hf_config=SimpleNamespace(kv_lora_rank=512))
    assert check_model_config(mla).reason == "mla"
    assert check_model_config(SimpleNamespace(is_hybrid_swa=True)).reason == "hybrid"
    assert check_model_config(SimpleNamespace(), hybrid=True).reason == "hybrid"
    cross = SimpleNamespace(is_encoder_decoder=True)  # SGLang's Mllama, Whisper
    assert check_model_config(cross).reason == "cross_attention"
