"""Contracts with the GPU attention backends SGLang 0.5.23 ships, checked on the CPU.

The backends (``FlashInferAttnBackend``, FA3's ``FlashAttentionBackend``,
``TritonAttnBackend``, ``HybridAttnBackend``) are SGLang's own classes, built by their own
``__init__`` over SGLang's CPU pools and ModelConfig, with a published server config.
Only what needs a GPU is replaced, each by a stand-in that does what its docstring says:
FlashInfer's wrappers (its module binds them only where flashinfer imports on CUDA),
``sgl_kernel.flash_attn`` and FA3's ``flash_attn_with_kvcache``, triton's extend kernel,
and the translator's triton kv-index gather. Each kernel stand-in attends by the plan the
real backend made and notes what the KV pool held when it ran, so a test sees which path
a phase batch takes and whether its K/V were written before any query attended.
"""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import ast
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

import torch
from sglang.srt.layers.attention import flashattention_backend as fa3_mod
from sglang.srt.layers.attention import flashinfer_backend as fi_mod
from sglang.srt.layers.attention import triton_backend as triton_mod
from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache import kv_index_translator as translator_mod
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor import model_runner as model_runner_mod
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sgl_pic.binding.phases import PhaseRunner, extend_backend
from sgl_pic.core.runs import SubRequest
from tests.support.fakes import FakeAllocator, FakeModelRunner, FakePool
from tests.support.sglang_cache import published_server_args

HEADS, KV_HEADS, DIM, LAYERS, SLOTS = 4, 2, 16, 2, 256
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HEADS * DIM,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": DIM,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def server_args(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """SGLang's ServerArgs for a tiny Llama, published as this process's config (what the
    backends read through ``get_exec()`` and friends); unpublished afterwards."""
    with published_server_args(tmp_path_factory.mktemp("model"), CONFIG) as args:
        yield args


# --- stand-ins for what needs a GPU ----------------------------------------------------


class Seen(NamedTuple):
    """What a kernel stand-in found: the pool's K and V at the slots the batch writes, as
    they were when the kernel ran."""

    k_at_out: torch.Tensor  # [n, kv_heads, head_dim]
    v_at_out: torch.Tensor


def causal_rows(
    q: torch.Tensor,  # [nq, heads, dim]
    k: torch.Tensor,  # [nk, kv_heads, dim]
    v: torch.Tensor,  # [nk, kv_heads, dim]
    scale: float,
) -> torch.Tensor:
    """# [nq, heads, dim] causal attention with the queries aligned to the last keys (query
    i sees keys 0..nk-nq+i), as FlashInfer's, FA3's and triton's extend kernels align it."""
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


class PagedPrefillWrapper:
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper, page size 1: ``begin_forward``
    records the plan; ``forward`` attends each request's queries (rows of qo_indptr) to its
    keys (kv_indices rows of kv_indptr) in the KV pool given, and notes the pool's state."""

    def __init__(self, workspace: torch.Tensor, layout: str, backend: str = "auto") -> None:
        assert layout == "NHD"
        self.plans: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.seen: list[Seen] = []
        self.out_cache_loc: torch.Tensor | None = None  # set by the test: slots to watch
        self.is_cuda_graph_enabled = False
        self._custom_mask_buf = None

    def begin_forward(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **_: Any,
    ) -> None:
        assert page_size == 1 and kv_indptr.numel() == qo_indptr.numel()
        n = int(kv_indptr[-1])
        self.plans.append((qo_indptr.clone(), kv_indptr.clone(), kv_indices[:n].clone()))

    def forward(
        self,
        q: torch.Tensor,  # [n, heads, dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # [slots, kv_heads, dim] each
        causal: bool = True,
        sm_scale: float | None = None,
        **_: Any,
    ) -> torch.Tensor:
        assert causal and sm_scale is not None
        k_buf, v_buf = kv_cache
        assert self.out_cache_loc is not None
        self.seen.append(Seen(k_buf[self.out_cache_loc].clone(), v_buf[self.out_cache_loc].clone()))
        qo, kv, idx = self.plans[-1]
        out = torch.empty_like(q)
        for b in range(qo.numel() - 1):
            keys = idx[int(kv[b]) : int(kv[b + 1])].long()
            rows = slice(int(qo[b]), int(qo[b + 1]))
            out[rows] = causal_rows(q[rows], k_buf[keys], v_buf[keys], sm_scale)
        return out


class RaggedPrefillWrapper:
    """flashinfer.BatchPrefillWithRaggedKVCacheWrapper: records that it was planned; it
    never attends here (a phase batch must not take this path)."""

    def __init__(self, workspace: torch.Tensor, layout: str, backend: str = "auto") -> None:
        self.plans: list[Any] = []

    def begin_forward(self, *args: Any, **kwargs: Any) -> None:
        self.plans.append(args)


class DecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper: built by the backend, unused here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class KvIndicesGather:
    """SGLang's ``create_flashinfer_kv_indices_triton`` (a triton kernel) for a token table
    (ENTRY_PAGE_SIZE 1, no token mapping): row b of the CSR stream is
    ``table[rows[b], start[b] : start[b] + lens[b]]``."""

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return self.run

    def run(
        self,
        table: torch.Tensor,  # [rows, width]
        rows: torch.Tensor,  # [bs]
        lens: torch.Tensor,  # [bs]
        indptr: torch.Tensor,  # [bs + 1]
        start: torch.Tensor | None,  # [bs]
        out: torch.Tensor,
        stride: int,
        ENTRY_PAGE_SIZE: int = 1,  # noqa: N803 - the kernel's own keyword
        TOKEN_BLOCK_PARALLEL: bool = False,  # noqa: N803
        token_mapping: torch.Tensor | None = None,
    ) -> None:
        assert ENTRY_PAGE_SIZE == 1 and token_mapping is None
        flat = table.reshape(-1)
        for b in range(lens.numel()):
            s = 0 if start is None else int(start[b])
            n, o, r = int(lens[b]), int(indptr[b]), int(rows[b])
            out[o : o + n] = flat[r * stride + s : r * stride + s + n].to(out.dtype)


class FlashAttnWithKVCache:
    """sgl_kernel's ``flash_attn_with_kvcache`` (FA3) for a page size of 1: request b's
    queries (rows of cu_seqlens_q) attend the first cache_seqlens[b] slots of its
    page_table row in the cache given; notes the pool's state when it runs."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.out_cache_loc: torch.Tensor | None = None

    def __call__(
        self,
        q: torch.Tensor,  # [n, heads, dim]
        k_cache: torch.Tensor,  # [pages, 1, kv_heads, dim]
        v_cache: torch.Tensor,
        page_table: torch.Tensor,  # [bs, max pages]
        cache_seqlens: torch.Tensor,  # [bs]
        cu_seqlens_q: torch.Tensor,  # [bs + 1]
        softmax_scale: float,
        causal: bool,
        **_: Any,
    ) -> torch.Tensor:
        assert causal and k_cache.shape[1] == 1
        k_buf, v_buf = k_cache[:, 0], v_cache[:, 0]
        assert self.out_cache_loc is not None
        self.seen.append(Seen(k_buf[self.out_cache_loc].clone(), v_buf[self.out_cache_loc].clone()))
        out = torch.empty_like(q)
        for b in range(cache_seqlens.numel()):
            keys = page_table[b, : int(cache_seqlens[b])].long()
            rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
            out[rows] = causal_rows(q[rows], k_buf[keys], v_buf[keys], softmax_scale)
        return out


class TritonExtend:
    """SGLang's triton ``extend_attention_fwd``: request b's queries (rows of qo_indptr)
    attend its prefix, read from the pool at kv_indices rows of kv_indptr, then its own
    new keys (the same rows of k_extend), causally; written into ``o``. Notes the pool."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.out_cache_loc: torch.Tensor | None = None

    def __call__(
        self,
        q: torch.Tensor,  # [n, heads, dim]
        k_extend: torch.Tensor,  # [n, kv_heads, dim]
        v_extend: torch.Tensor,
        o: torch.Tensor,  # [n, heads, dim]
        k_buffer: torch.Tensor,  # [slots, kv_heads, dim]
        v_buffer: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        custom_mask: torch.Tensor | None,
        causal: bool,
        mask_indptr: torch.Tensor | None,
        max_len_extend: int,
        k_descale: float,
        v_descale: float,
        sm_scale: float,
        **_: Any,
    ) -> None:
        assert causal and custom_mask is None
        assert self.out_cache_loc is not None
        self.seen.append(
            Seen(k_buffer[self.out_cache_loc].clone(), v_buffer[self.out_cache_loc].clone())
        )
        for b in range(qo_indptr.numel() - 1):
            rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            prefix = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            k = torch.cat([k_buffer[prefix], k_extend[rows]])
            v = torch.cat([v_buffer[prefix], v_extend[rows]])
            o[rows] = causal_rows(q[rows], k, v, sm_scale)


@pytest.fixture
def gpu_stubs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The GPU pieces above in place of SGLang's, for one test."""
    monkeypatch.setattr(fi_mod, "BatchPrefillWithPagedKVCacheWrapper", PagedPrefillWrapper, False)
    monkeypatch.setattr(fi_mod, "BatchPrefillWithRaggedKVCacheWrapper", RaggedPrefillWrapper, False)
    monkeypatch.setattr(fi_mod, "BatchDecodeWithPagedKVCacheWrapper", DecodeWrapper, False)
    monkeypatch.setattr(translator_mod, "create_flashinfer_kv_indices_triton", KvIndicesGather())
    fa3 = FlashAttnWithKVCache()
    monkeypatch.setattr(fa3_mod, "flash_attn_with_kvcache", fa3)
    flash_attn = types.ModuleType("sgl_kernel.flash_attn")
    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache", "get_scheduler_metadata"):
        setattr(flash_attn, name, _not_on_this_path(name))
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn", flash_attn)
    return types.SimpleNamespace(fa3=fa3)


def _not_on_this_path(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} is not on a phase batch's path")

    return call


# --- SGLang's pools, a runner over them, and a phase batch -------------------------------


class Env:
    """Two prompts (rows of SGLang's request table over shuffled slots, K/V random) and a
    runner over SGLang's own pools, translator and ModelConfig."""

    def __init__(self, server_args: Any, backend: str) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        g = torch.Generator().manual_seed(0)
        self.req_pool = ReqToTokenPool(8, 128, "cpu", False)
        self.pool = MHATokenToKVPool(
            size=SLOTS,
            page_size=1,
            dtype=torch.float32,
            head_num=KV_HEADS,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        allocator = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", self.pool, need_sort=False)
        self.translator = KVIndexTranslator(
            req_to_token=self.req_pool.req_to_token,
            token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=self.pool,
            page_size=1,
            device="cpu",
            is_draft_worker=False,
        )
        self.runner = FakeModelRunner(
            ModelConfig.from_server_args(server_args),
            server_args,
            self.req_pool,
            self.pool,
            allocator,
            self.translator,
            backend,
        )
        perm = torch.randperm(SLOTS - 1, generator=g)[:100] + 1
        self.rows = self.req_pool.alloc_rows(2)
        self.req_pool.req_to_token[self.rows[0], :60] = perm[:60].int()
        self.req_pool.req_to_token[self.rows[1], :40] = perm[60:].int()
        for layer in range(LAYERS):
            for buf in (self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer)):
                buf[:] = torch.randn(buf.shape, generator=g)
        self.layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=1)
        self.g = g

    def live(self) -> ForwardBatch:
        """The live extend batch SGLang built: row 0 extends 60 tokens, row 1 20 from 20."""
        table = self.req_pool.req_to_token
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=2,
            input_ids=torch.arange(80),
            req_pool_indices=torch.tensor(self.rows, dtype=torch.int64),
            seq_lens=torch.tensor([60, 40]),
            out_cache_loc=torch.cat([table[self.rows[0], :60], table[self.rows[1], 20:40]]).long(),
            seq_lens_sum=100,
            extend_prefix_lens_cpu=[0, 20],
            extend_seq_lens_cpu=[60, 20],
            rids=["a", "b"],
        )

    def subrequests(self) -> list[SubRequest]:
        """Three runs of row 0 (each later run's prefix holds the earlier runs' slots) and
        row 1 as the plain request it is."""
        r0, r1 = self.rows
        return [SubRequest(r0, 3, 5), SubRequest(r0, 20, 1), SubRequest(r0, 50, 10)] + [
            SubRequest(r1, 20, 20)
        ]


def check_write_before_attend(
    env: Env, backend: Any, runner: PhaseRunner, seen: list[Seen], watch: Any
) -> None:
    """SGLang's forward_extend of ``backend`` over the phase batch (``runner`` planned it):
    the pool held this layer's new K/V at every written slot when the kernel ran, and the
    output and the pool equal SGLang's torch_native over the same batch (each query sees
    its row's keys up to its own position, the fresh K/V of earlier runs included)."""
    subs = env.subrequests()
    n = sum(s.extend for s in subs)
    phase = runner.prepare(env.live(), subs, torch.arange(n))
    fb = phase.forward_batch
    watch.out_cache_loc = fb.out_cache_loc
    q = torch.randn(n, HEADS * DIM, generator=env.g)
    k = torch.randn(n, KV_HEADS, DIM, generator=env.g)
    v = torch.randn(n, KV_HEADS, DIM, generator=env.g)
    before = env.pool.get_key_buffer(1).clone(), env.pool.get_value_buffer(1).clone()
    ours = backend.forward_extend(q, k, v, env.layer, fb)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0].k_at_out, k)
    torch.testing.assert_close(seen[0].v_at_out, v)
    after = env.pool.get_key_buffer(1).clone(), env.pool.get_value_buffer(1).clone()
    env.pool.get_key_buffer(1)[:] = before[0]
    env.pool.get_value_buffer(1)[:] = before[1]
    native = TorchNativeAttnBackend(env.runner)
    native.init_forward_metadata(fb)
    theirs = native.forward_extend(q, k, v, env.layer, fb)
    torch.testing.assert_close(ours.view(n, -1), theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[0], env.pool.get_key_buffer(1))
    torch.testing.assert_close(after[1], env.pool.get_value_buffer(1))


# --- finding 2: FlashInfer's phase batches take its paged path --------------------------


def flashinfer_plan(env: Env, backend: Any, runner: PhaseRunner) -> tuple[Any, ...]:
    subs = env.subrequests()
    runner.prepare(env.live(), subs, torch.arange(sum(s.extend for s in subs)))
    return backend.prefill_wrappers_paged[0].plans[-1]


def test_flashinfer_plans_phase_batches_on_its_paged_path(server_args: Any, gpu_stubs: Any) -> None:
    # SGLang's FlashInferAttnBackend names its kernel family ``prefill_backend = "fa2"``;
    # phase batches must still be planned paged (ragged attends before this layer writes).
    env = Env(server_args, "flashinfer")
    backend = fi_mod.FlashInferAttnBackend(env.runner)
    assert backend.prefill_backend == "fa2" and backend.use_paged is False
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    qo, kv, idx = flashinfer_plan(env, backend, runner)
    assert backend.forward_metadata.use_ragged is False
    assert backend.prefill_wrapper_ragged.plans == []
    assert backend.use_paged is False  # SGLang's own batches keep its default
    # Paged plan: each sub-request's queries against its row's whole first prefix+extend.
    subs = env.subrequests()
    assert qo.tolist() == [0, 5, 6, 16, 36]
    assert kv.tolist() == [0, 8, 29, 89, 129]
    table = env.req_pool.req_to_token
    expect = torch.cat([table[s.pool_idx, : s.prefix + s.extend] for s in subs])
    assert idx.tolist() == expect.tolist()
    # Its plan buffers hold a request-table's worth of sub-requests (``max_subrequests``).
    assert runner.max_subrequests == env.req_pool.size
    assert backend.kv_indptr[0].numel() >= env.req_pool.size + 1
    assert backend.qo_indptr[0].numel() >= env.req_pool.size + 1


def test_flashinfer_writes_before_its_paged_kernel_attends(
    server_args: Any, gpu_stubs: Any
) -> None:
    env = Env(server_args, "flashinfer")
    backend = fi_mod.FlashInferAttnBackend(env.runner)
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    paged = backend.prefill_wrappers_paged[0]
    check_write_before_attend(env, backend, runner, paged.seen, paged)


def test_a_ragged_plan_is_refused_not_served(server_args: Any, gpu_stubs: Any) -> None:
    # If FlashInfer ever planned a phase batch ragged, the batch must not run on it.
    env = Env(server_args, "flashinfer")
    backend = fi_mod.FlashInferAttnBackend(env.runner)
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    plan = backend.init_forward_metadata

    def ragged(fb: Any) -> None:
        saved, backend.use_paged = backend.use_paged, False
        try:
            plan(fb)
        finally:
            backend.use_paged = saved

    backend.init_forward_metadata = ragged
    with pytest.raises(RuntimeError, match="ragged"):
        flashinfer_plan(env, backend, runner)


def test_hybrid_plans_and_attends_with_its_prefill_backend(
    server_args: Any, gpu_stubs: Any
) -> None:
    # --prefill-attention-backend flashinfer --decode-attention-backend triton: SGLang's
    # HybridAttnBackend routes extend batches to FlashInfer, which must plan them paged.
    env = Env(server_args, "flashinfer")
    prefill = fi_mod.FlashInferAttnBackend(env.runner)
    decode = triton_mod.TritonAttnBackend(env.runner)
    hybrid = HybridAttnBackend(env.runner, prefill, decode)
    assert hybrid._select_backend(ForwardMode.EXTEND) is prefill
    assert extend_backend(hybrid) is prefill and extend_backend(prefill) is prefill
    runner = PhaseRunner(hybrid, env.req_pool.req_to_token, env.translator, env.req_pool)
    paged = prefill.prefill_wrappers_paged[0]
    check_write_before_attend(env, hybrid, runner, paged.seen, paged)
    assert prefill.forward_metadata.use_ragged is False and prefill.use_paged is False
    assert prefill.prefill_wrapper_ragged.plans == []
    assert runner.max_subrequests == env.req_pool.size
    # torch_native as the prefill half: phase batches take torch_native_phase_extend,
    # which plans nothing per request, so nothing caps them.
    native = HybridAttnBackend(env.runner, TorchNativeAttnBackend(env.runner), decode)
    table = env.req_pool.req_to_token
    assert PhaseRunner(native, table, None, env.req_pool).max_subrequests is None


# --- FA3 and triton: write first by construction ---------------------------------------


def test_fa3_writes_before_it_attends(server_args: Any, gpu_stubs: Any) -> None:
    env = Env(server_args, "fa3")
    backend = fa3_mod.FlashAttentionBackend(env.runner)
    # Embedding servers without a radix cache skip the pool altogether; not these.
    assert backend.fa_skip_kv_cache is False and backend.page_size == 1
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    check_write_before_attend(env, backend, runner, gpu_stubs.fa3.seen, gpu_stubs.fa3)
    assert runner.max_subrequests == env.req_pool.size


def test_triton_writes_before_it_attends(server_args: Any, gpu_stubs: Any) -> None:
    env = Env(server_args, "triton")
    backend = triton_mod.TritonAttnBackend(env.runner)
    kernel = TritonExtend()
    # SGLang's __init__ binds the kernel on the instance (torch.compiler.disable).
    assert callable(backend.extend_attention_fwd)
    backend.extend_attention_fwd = kernel
    assert backend.enable_deterministic is False and backend.dcp_size == 1
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    check_write_before_attend(env, backend, runner, kernel.seen, kernel)
    assert backend.kv_indptr.numel() >= env.req_pool.size + 1
    assert backend.qo_indptr.numel() >= env.req_pool.size + 1


# --- the fakes of tests/integration mirror SGLang's classes ----------------------------


def assigned_attributes(cls: type) -> set[str]:
    """Names ``cls`` (and its bases) define or assign on ``self`` in their source."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def test_fake_model_runner_sets_only_what_model_runner_sets(server_args: Any) -> None:
    env = Env(server_args, "flashinfer")
    fake = {n for n in vars(env.runner)} | {
        n for n, _ in inspect.getmembers(FakeModelRunner, inspect.isfunction)
    }
    real = assigned_attributes(model_runner_mod.ModelRunner)
    assert fake - {"__init__"} <= real, sorted(fake - real)
    # The one method it borrows gives what ModelRunner's gives a plain runner.
    assert env.runner.decode_num_tokens_per_req() == 1


def test_fake_pool_mirrors_mha_pool() -> None:
    pool = MHATokenToKVPool(
        size=16,
        page_size=1,
        dtype=torch.float32,
        head_num=KV_HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    fake = FakePool(17, LAYERS, KV_HEADS, DIM)
    for name in ("get_key_buffer", "get_value_buffer", "k_buffer", "v_buffer"):
        assert hasattr(pool, name) and hasattr(fake, name)
    for real_buf, fake_buf in ((pool.k_buffer, fake.k_buffer), (pool.v_buffer, fake.v_buffer)):
        assert isinstance(real_buf, list) and len(real_buf) == len(fake_buf) == LAYERS
        # Per layer [size + page_size (slot 0 pads), heads, dim].
        assert real_buf[1].shape == fake_buf[1].shape == (17, KV_HEADS, DIM)
    # get_*_buffer hand out the live buffer: a write through it is a write to the pool.
    assert pool.get_key_buffer(1) is pool.k_buffer[1] and fake.get_key_buffer(1) is fake.k_buffer[1]
    assert pool.get_value_buffer(0) is pool.v_buffer[0]
    for name in ("get_key_buffer", "get_value_buffer"):
        real_params = list(inspect.signature(getattr(MHATokenToKVPool, name)).parameters)
        fake_params = list(inspect.signature(getattr(FakePool, name)).parameters)
        assert len(real_params) == len(fake_params) == 2


def test_fake_allocator_mirrors_sglangs() -> None:
    pool = MHATokenToKVPool(
        size=16,
        page_size=1,
        dtype=torch.float32,
        head_num=KV_HEADS,
        head_dim=DIM,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    real = TokenToKVPoolAllocator(16, torch.float32, "cpu", pool, need_sort=False)
    fake = FakeAllocator(16)
    for name, params in (("alloc", ["need_size"]), ("free", ["free_index"])):
        assert list(inspect.signature(getattr(real, name)).parameters) == params
        assert list(inspect.signature(getattr(fake, name)).parameters) == params
    assert real.page_size == fake.page_size == 1 and real.size == fake.size == 16
    assert real.available_size() == fake.available_size() == 16
    # Slot 0 is SGLang's padding slot: neither hands it out; too large a request is None.
    got, mine = real.alloc(16), fake.alloc(16)
    assert got is not None and mine is not None
    assert 0 not in got.tolist() and 0 not in mine.tolist()
    assert sorted(got.tolist()) == sorted(mine.tolist()) == list(range(1, 17))
    assert real.alloc(1) is None and fake.alloc(1) is None
    real.free(got[:4])
    fake.free(mine[:4])
    assert real.available_size() == fake.available_size() == 4


# ForwardBatch fields the backends' extend paths read that a phase batch takes unchanged
# from the live batch, and why that is right.
LENT_BY_THE_LIVE_BATCH = {
    "cross_attention_custom_mask": "encoder-decoder only; check_support refuses cross attention",
    "spec_algorithm": "speculative decoding is refused by check_support",
}


def forward_batch_reads(fn: Any) -> set[str]:
    """The ``forward_batch.X`` names ``fn``'s source reads."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "forward_batch"
    }


@pytest.mark.parametrize(
    "backend",
    [fi_mod.FlashInferAttnBackend, fa3_mod.FlashAttentionBackend, triton_mod.TritonAttnBackend],
    ids=["flashinfer", "fa3", "triton"],
)
def test_a_phase_batch_sets_what_extend_planning_reads(backend: type) -> None:
    # A field SGLang's extend path reads and build_phase_batch does not set would carry the
    # live batch's value into a phase batch of other sub-requests: a wrong plan on a GPU.
    from sglang.srt.model_executor.forward_batch_deepseek_mha_mixin import (
        ForwardBatchDeepSeekMHAMixin,
    )

    from sgl_pic.binding import phases

    read = forward_batch_reads(backend.init_forward_metadata)
    read |= forward_batch_reads(backend.forward_extend)
    replaced: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(phases.build_phase_batch))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "replace":
            replaced = {k.arg for k in node.keywords if k.arg}
    assert {"out_cache_loc", "extend_prefix_lens", "seq_lens_cpu", "kv_loc_plan"} <= replaced
    # MLA's chunked-prefix attributes are class defaults, not fields: replace() leaves a
    # phase batch with the defaults (MLA is refused by check_support).
    mla = set(ForwardBatchDeepSeekMHAMixin.__annotations__)
    fields = set(ForwardBatch.__dataclass_fields__)
    assert read - mla <= fields, sorted(read - mla - fields)
    lent = read - replaced - mla
    assert lent <= set(LENT_BY_THE_LIVE_BATCH), sorted(lent - set(LENT_BY_THE_LIVE_BATCH))
