"""The support check on SGLang's resolved arguments: resolved values are read (not the raw
record), every prefill graph backend is served, page sizes must agree, and every refusal
names the flag that lifts it. (A whole launch on a mocked CUDA GPU:
``tests/cli/test_launch_server.py``.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pic.binding.self_check import (
    check_args,
    check_launch,
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
