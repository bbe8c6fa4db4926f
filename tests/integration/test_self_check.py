"""The support check on SGLang's resolved arguments: a default launch on a CUDA GPU
(mocked) serves reuse with SGLang's prefill CUDA graphs on, resolved values are read (not
the raw record), page sizes must agree, and every refusal names the flag that lifts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pic.integration.self_check import (
    check_args,
    check_launch,
    check_page_size,
)

ROOT = Path(__file__).resolve().parents[2]


def resolved_args(**declared: Any) -> Any:
    """A record as SGLang's resolution leaves it: raw fields unset (``None``), the
    decisions in ``_resolved_overrides`` (``overrides.declare_resolution``'s stash)."""
    raw = SimpleNamespace(attention_backend=None, page_size=None, cuda_graph_config=None)
    raw._resolved_overrides = [("_resolution", declared)]
    return raw


def cuda_launch(gpu: str, mode: str, *argv: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.cuda_args", gpu, mode, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1])


@pytest.mark.sglang
def test_a_default_launch_on_a_cuda_gpu_serves_reuse_with_prefill_graphs() -> None:
    # SGLang resolves breakable prefill CUDA graphs by default on CUDA; the chunk path runs
    # beside them (its batches are kept off the graph), so the check accepts.
    got = cuda_launch("h100", "sglang")
    assert got["prefill_graph"] == "breakable" and got["attention"][0] == "fa3"
    assert (got["reason"], got["detail"]) == ("", "")
    assert got["config_page_size"] == got["pool_page_size"] == 1


@pytest.mark.sglang
def test_a_default_launch_on_blackwell_serves_reuse_at_the_pools_page_size() -> None:
    # SGLang's default there is trtllm_mha, which also raises the page size to 64; the
    # launcher names a covered backend instead, and pads chunk starts to the page size
    # SGLang resolved.
    got = cuda_launch("b200", "launcher")
    assert got["attention"][0] == "flashinfer" and got["prefill_graph"] == "breakable"
    assert (got["reason"], got["detail"]) == ("", "")
    assert got["config_page_size"] == got["pool_page_size"] == got["page_size"]


def test_checks_read_the_resolved_arguments_not_the_raw_record() -> None:
    # A default launch leaves attention_backend None on the record itself.
    support = check_args(resolved_args(attention_backend="trtllm_mha"))
    assert support.reason == "backend" and "--attention-backend" in support.detail
    assert check_args(resolved_args(attention_backend="fa3")).ok
    support = check_args(resolved_args(attention_backend="fa3", decode_attention_backend="fa4"))
    assert support.reason == "backend" and "--decode-attention-backend" in support.detail
    support = check_args(resolved_args(attention_backend="fa3", kv_cache_dtype="fp8_e4m3"))
    assert support.reason == "kv_dtype" and "--kv-cache-dtype auto" in support.detail


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

    from sgl_pic.integration.cpu_env import activate_cpu_stubs

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
