"""SGLang's own cache objects and published config, built the same way for the tests that
drive SGLang's real classes without a server. SGLang is imported inside each function:
the calling module activates the CPU stubs (``binding.cpu_env``) before it does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def kv_pool_and_allocator(size: int, page_size: int = 1) -> tuple[Any, Any]:
    """SGLang's MHATokenToKVPool (2 layers, 2 KV heads of 4, float32, CPU) of ``size`` slots
    and its token-to-KV allocator: ``TokenToKVPoolAllocator`` at page size 1,
    ``PagedTokenToKVPoolAllocator`` above."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.float32,
        head_num=2,
        head_dim=4,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    if page_size == 1:
        return pool, TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, False)
    return pool, PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", pool, False)


def cache_params(allocator: Any, page_size: int, rows: int, row_tokens: int) -> Any:
    """SGLang's CacheInitParams of a full-attention radix cache over ``allocator``, with a
    request table of ``rows`` rows of ``row_tokens``."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(rows, row_tokens, "cpu", False),
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tree_components=(ComponentType.FULL,),
    )


@contextmanager
def published_server_args(root: Path, config: dict[str, Any]) -> Iterator[Any]:
    """SGLang's ServerArgs for the model ``config`` (written to ``root``/config.json),
    published as this process's config (what SGLang's classes read through
    ``get_schedule()``, ``get_exec()`` and friends); unpublished afterwards."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    (root / "config.json").write_text(json.dumps(config))
    args = ServerArgs(model_path=str(root), device="cpu")
    reset_context()
    publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield args
    finally:
        reset_context()
