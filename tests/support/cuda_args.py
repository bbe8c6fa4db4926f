"""SGLang's own server-argument resolution on a machine that reports a CUDA GPU (mocked),
then the scheduler's support check on a build context made from the resolved arguments.

Run as ``python -m tests.support.cuda_args GPU MODE [ARGV...]`` (GPU: ``h100`` or
``b200``; ARGV names the embedded model unless it has ``--model-path``); prints one JSON
line. A child process: the mocks and SGLang's cached platform probes must
not leak into the test process. The launcher's ``build`` makes the argv, and SGLang's
``prepare_server_args`` + ``ServerArgs.resolve_once`` resolve it (``launcher`` mode: through
``launch_server.resolve_server_args``, as ``main`` does). The build context is SGLang's
``TreeCacheBuildContext`` holding SGLang's real KV pool and allocator (on the CPU, sized
small, at the resolved page size and dtype), the prefill graph runner class SGLang's
``capture_prefill_graph`` picks for the resolved prefill graph backend, and SGLang's
``ModelConfig`` for the resolved arguments with the hybrid flags its ``build_kv_cache``
derives from it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0)),
    "b200": ("NVIDIA B200", (10, 0)),
}


def write_hybrid_swa_model(path: Path) -> Path:
    """A model directory holding only a small GPT-OSS ``config.json``: an architecture
    SGLang serves with hybrid sliding-window attention (``SWA_SINK_ARCHS`` in
    ``configs/model_config.py``) and with its own attention backends only; enough for
    SGLang's argument resolution and ``ModelConfig``, which read the config alone."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 64,
        "head_dim": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 128,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def _mock_cuda(gpu: str) -> None:
    """torch and SGLang's platform probes report one ``gpu`` with 80 GiB."""
    name, capability = GPUS[gpu]
    for target, value in (
        ("torch.cuda.is_available", True),
        ("torch.cuda.get_device_name", name),
        ("torch.cuda.get_device_capability", capability),
        ("torch.cuda.device_count", 1),
        ("torch.cuda.mem_get_info", (80 * 2**30, 80 * 2**30)),
    ):
        mock.patch(target, return_value=value).start()
    mock.patch("torch.version.cuda", "12.8").start()
    # A GPU install of SGLang ships FlashInfer; this CPU one does not.
    from sglang.srt.utils import common

    mock.patch.object(common, "is_flashinfer_available", lambda: True).start()
    for value in vars(common).values():
        if hasattr(value, "cache_clear"):
            value.cache_clear()  # SGLang caches its probes (is_cuda, is_sm100_supported, ...)
    import sglang.srt.platforms as platforms
    from sglang.srt.platforms.cuda import CudaSRTPlatform

    platforms._current_platform = CudaSRTPlatform()


def main(argv: list[str]) -> None:
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()  # SGLang's CPU-only imports, before the machine turns "CUDA"
    import sglang.srt.arg_groups.pipeline  # noqa: F401
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.configs.model_config import ModelConfig, is_deepseek_dsa
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    from sgl_pic.binding import plugin
    from sgl_pic.binding.model_hooks import check_support
    from sgl_pic.cli import launch_server
    from sgl_pic.model.embedded import ensure_embedded_model
    from tests.binding.test_model_hooks import Model

    gpu, mode, *user = argv
    if "--model-path" not in user:
        user = ["--model-path", str(ensure_embedded_model().path), *user]
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    _mock_cuda(gpu)
    sglang_argv, _ns, config = launch_server.build(user)
    if mode == "launcher":
        args, sglang_argv = launch_server.resolve_server_args(sglang_argv)
        config = launch_server.launch_check(args, config)
    else:  # as SGLang's run_server resolves what it is given
        args = prepare_server_args(sglang_argv)
        args.resolve_once()
    view = resolved_view(args)
    model_config = ModelConfig.from_server_args(args)  # as SGLang's scheduler builds it
    graph_backend = view.cuda_graph_config.prefill.backend
    page = int(view.page_size or 1)
    mock.patch.stopall()

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(view.dtype), torch.bfloat16 if str(view.dtype) == "auto" else torch.float32
    )
    pool = MHATokenToKVPool(16 * page, page, dtype, 2, 8, 2, "cpu", False)
    if page == 1:
        allocator = TokenToKVPoolAllocator(16, dtype, "cpu", pool, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(16 * page, page, dtype, "cpu", pool, False)
    # capture_prefill_graph: the EagerRunner when the prefill graph is disabled, else a
    # PrefillCudaGraphRunner (its capture needs a GPU; the class is what is checked).
    runner_cls = EagerRunner if graph_backend == "disabled" else PrefillCudaGraphRunner
    graph_runner = object.__new__(runner_cls)
    ctx = TreeCacheBuildContext(
        server_args=args,
        params=SimpleNamespace(token_to_kv_pool_allocator=allocator, page_size=page),
        # As SGLang's build_kv_cache derives them (mem_cache/kv_cache_builder.py).
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_ssm=uses_ssm_state(model_config),
        is_dsa=is_deepseek_dsa(model_config.hf_config),
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=SimpleNamespace(
            model_runner=SimpleNamespace(model=Model(), prefill_cuda_graph_runner=graph_runner)
        ),
        model_config=model_config,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    plugin.register()
    HookRegistry.apply_hooks()  # as SGLang's load_plugins() does after registering
    support = check_support(ctx)
    print(
        json.dumps(
            {
                "attention": [view.attention_backend, view.decode_attention_backend],
                "prefill_graph": graph_backend,
                "decode_graph": view.cuda_graph_config.decode.backend,
                "page_size": page,
                "pool_page_size": allocator.page_size,
                "config_page_size": config.page_size,
                "reason": support.reason,
                "detail": support.detail,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
