"""Stand-ins for SGLang's token-to-KV allocator and KV pool, for tests without a server.

Both really keep state: the allocator tracks every slot it handed out and refuses a free
of a slot it does not consider allocated (a double free, a foreign slot) or of part of a
page, so leaks and double frees show up; the pool holds real per-layer buffers that
writes land in. ``chunk_data`` makes a chunk's KV as phase 1 would leave it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from sgl_pic.rope import rotate_layers


class AllocatorMisuse(AssertionError):
    """A free the allocator cannot accept: double free, foreign slot, partial page."""


class FakeAllocator:
    """Page-granular, like SGLang's allocators: page p covers slots p*page_size ..
    p*page_size + page_size - 1, and page 0 is reserved (SGLang's padding slot 0), so
    slots handed out are never 0. ``alloc(n)`` needs whole pages (SGLang's paged
    allocator asserts the same) and returns None when too few are free."""

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        self.page_size = page_size
        self.size = num_pages * page_size
        self._free_pages: list[int] = list(range(1, num_pages + 1))
        self._allocated: set[int] = set()
        self.initial_free: frozenset[int] = self.free_slots()
        self.alloc_sizes: list[int] = []
        self.freed_slots = 0

    def free_slots(self) -> frozenset[int]:
        ps = self.page_size
        return frozenset(p * ps + i for p in self._free_pages for i in range(ps))

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size % self.page_size:
            raise AllocatorMisuse(f"alloc({need_size}) is not whole pages of {self.page_size}")
        self.alloc_sizes.append(need_size)
        pages = need_size // self.page_size
        if pages > len(self._free_pages):
            return None
        take, self._free_pages = self._free_pages[:pages], self._free_pages[pages:]
        ps = self.page_size
        slots = [p * ps + i for p in take for i in range(ps)]
        self._allocated.update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, free_index: torch.Tensor) -> None:
        slots = [int(s) for s in free_index.tolist()]
        if len(set(slots)) != len(slots):
            raise AllocatorMisuse(f"slots freed twice in one call: {slots}")
        stray = [s for s in slots if s not in self._allocated]
        if stray:
            raise AllocatorMisuse(f"slots freed but not allocated (double free?): {stray}")
        ps = self.page_size
        pages = {s // ps for s in slots}
        if len(pages) * ps != len(slots):
            raise AllocatorMisuse(f"free of partial pages: {slots}")
        self._allocated.difference_update(slots)
        self._free_pages.extend(sorted(pages))
        self.freed_slots += len(slots)


SENTINEL = 777.0


class FakePool:
    """Per-layer K and V buffers # [size, heads, head_dim], as SGLang's MHATokenToKVPool
    exposes them (get_key_buffer / get_value_buffer return the live buffer)."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        heads: int,
        head_dim: int,
        fill: float = SENTINEL,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (size, heads, head_dim)
        self.k_buffer = [torch.full(shape, fill, dtype=dtype) for _ in range(num_layers)]
        self.v_buffer = [torch.full(shape, fill, dtype=dtype) for _ in range(num_layers)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[layer]

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """# [num_layers, size, heads, head_dim] copies of all K and of all V."""
        return torch.stack(self.k_buffer).clone(), torch.stack(self.v_buffer).clone()


class ChunkData(NamedTuple):
    """One chunk's KV as phase 1 leaves it, and the pre-RoPE keys it came from.

    pre_k: # [num_layers, n, heads, head_dim] keys before RoPE.
    kv:    # [num_layers, 2, n, heads, head_dim] keys post-RoPE at positions 0..n-1.
    """

    tokens: list[int]
    pre_k: torch.Tensor
    v: torch.Tensor
    kv: torch.Tensor
    ranking: torch.Tensor


def chunk_data(
    seed: int, n: int, num_layers: int, heads: int, head_dim: int, inv_freq: torch.Tensor
) -> ChunkData:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 30000, (n,), generator=g).tolist()
    pre_k = torch.randn(num_layers, n, heads, head_dim, generator=g)
    v = torch.randn(num_layers, n, heads, head_dim, generator=g)
    post = rotate_layers(pre_k, torch.arange(n), inv_freq)
    return ChunkData(tokens, pre_k, v, torch.stack([post, v], dim=1), torch.rand(n, generator=g))


class FakeModelRunner:
    """The attributes of SGLang's ModelRunner that its attention backends (FlashInfer, FA3,
    triton, hybrid, torch_native) read when built, each one ModelRunner sets itself
    (``test_backend_contracts`` checks the names against its source). ``model_config`` is
    SGLang's own ModelConfig; the pools, allocator and translator are SGLang's CPU ones.
    Serving defaults: one GPU rank's runner, no speculative decoding, no sliding window."""

    def __init__(
        self,
        model_config: Any,  # sglang ModelConfig
        server_args: Any,  # sglang ServerArgs (the published one)
        req_to_token_pool: Any,  # sglang ReqToTokenPool
        token_to_kv_pool: Any,  # sglang MHATokenToKVPool
        token_to_kv_pool_allocator: Any,
        kv_index_translator: Any,  # sglang KVIndexTranslator
        backend: str,  # --attention-backend
        page_size: int = 1,
    ) -> None:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.model_config = model_config
        self.server_args = server_args
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.kv_index_translator = kv_index_translator
        self.prefill_attention_backend_str = backend
        self.decode_attention_backend_str = backend
        self.kv_cache_dtype = token_to_kv_pool.dtype
        self.kv_cache_dtype_str = "auto"
        self.dtype = model_config.dtype
        self.page_size = page_size
        self.sliding_window_size: int | None = None
        self.device = "cpu"
        self.gpu_id = 0
        self.is_draft_worker = False
        self.spec_algorithm = SpeculativeAlgorithm.from_string(None)

    def decode_num_tokens_per_req(self, **kwargs: Any) -> int:
        """ModelRunner's own method, run on this runner."""
        from sglang.srt.model_executor.model_runner import ModelRunner

        return ModelRunner.decode_num_tokens_per_req(self, **kwargs)  # type: ignore[arg-type]
