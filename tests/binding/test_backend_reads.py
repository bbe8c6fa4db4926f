"""The KV-read model (``engine.kv_reads``) against the plans SGLang's own FlashInfer and
FA3 backends make of a phase batch, on the CPU.

The backends and stand-ins are those of ``test_backend_contracts``: the real backend plans
the batch; the stand-in kernel receives that plan (FlashInfer: qo/kv indptr; FA3:
cu_seqlens_q and cache_seqlens). Reads are counted from the plan by brute force, each
packed query row (token, head of its KV head's group) seeing the keys the stand-in's
causal attention gives it, and each tile reading what its last-seeing row sees, and
compared with the model's count from the sub-requests alone.
"""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

import torch
from sglang.srt.layers.attention import flashattention_backend as fa3_mod
from sglang.srt.layers.attention import flashinfer_backend as fi_mod

from sgl_pic.binding.phases import PhaseRunner
from sgl_pic.engine import kv_reads
from sgl_pic.engine.kv_reads import AttnShape, planned_reads
from tests.binding import test_backend_contracts as contracts
from tests.binding.test_backend_contracts import DIM, HEADS, KV_HEADS, Env, FlashAttnWithKVCache

# The contract tests' fixtures: SGLang's published config, the GPU stand-ins.
server_args = contracts.server_args
gpu_stubs = contracts.gpu_stubs
SHAPE = AttnShape(HEADS // KV_HEADS, DIM)


def brute_reads(qo_lens: list[int], kv_lens: list[int], rows: int, block_kv: int) -> int:
    """KV tokens a causal plan of these requests reads in tiles of ``rows`` packed rows:
    row r of a request is its token r // group (head r % group), which sees its
    request's first kv_len - qo_len + token + 1 keys."""
    g = SHAPE.group
    total = 0
    for nq, nk in zip(qo_lens, kv_lens, strict=True):
        seen = [nk - nq + r // g + 1 for r in range(nq * g)]
        for m in range(0, len(seen), rows):
            total += min(nk, math.ceil(max(seen[m : m + rows]) / block_kv) * block_kv)
    return total


def model_reads(env: Env, backend: str) -> int:
    subs = env.subrequests()
    return planned_reads(backend, [kv_reads.SubRequest(s.prefix, s.extend) for s in subs], SHAPE)


def test_flashinfers_plan_reads_what_the_model_counts(server_args: Any, gpu_stubs: Any) -> None:
    env = Env(server_args, "flashinfer")
    backend = fi_mod.FlashInferAttnBackend(env.runner)
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    subs = env.subrequests()
    runner.prepare(env.live(), subs, torch.arange(sum(s.extend for s in subs)))
    qo, kv, _ = backend.prefill_wrappers_paged[0].plans[-1]
    qo_lens = (qo[1:] - qo[:-1]).tolist()
    kv_lens = (kv[1:] - kv[:-1]).tolist()
    # One request per sub-request, each over its row through its last position.
    assert qo_lens == [s.extend for s in subs]
    assert kv_lens == [s.prefix + s.extend for s in subs]
    # FlashInfer's tile from the plan: the average packed query rows over its requests.
    avg = int(qo[-1]) * SHAPE.group // (qo.numel() - 1)
    rows = kv_reads.flashinfer_rows(avg, DIM)
    assert rows == 64  # (5 + 1 + 10 + 20) x 2 / 4 = 18 rows on average
    assert brute_reads(qo_lens, kv_lens, rows, 1) == model_reads(env, "flashinfer")
    # The runs cost more than the request they recompute: row 0's three runs read its
    # prefix each, where its exact prefill (60 tokens, one 128-row tile) reads 60 keys.
    exact = kv_reads.exact_reads("flashinfer", 60, SHAPE)
    assert exact == brute_reads([60], [60], 128, 1) == 60
    assert brute_reads(qo_lens[:3], kv_lens[:3], rows, 1) > exact


class RecordingFA3(FlashAttnWithKVCache):
    """The FA3 stand-in, also keeping the plan each call attends by."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[tuple[list[int], list[int]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        cu = kwargs["cu_seqlens_q"]
        self.plans.append(((cu[1:] - cu[:-1]).tolist(), kwargs["cache_seqlens"].tolist()))
        return super().__call__(*args, **kwargs)


def test_fa3s_plan_reads_what_the_model_counts(
    server_args: Any, gpu_stubs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = RecordingFA3()
    monkeypatch.setattr(fa3_mod, "flash_attn_with_kvcache", kernel)
    env = Env(server_args, "fa3")
    backend = fa3_mod.FlashAttentionBackend(env.runner)
    runner = PhaseRunner(backend, env.req_pool.req_to_token, env.translator, env.req_pool)
    subs = env.subrequests()
    n = sum(s.extend for s in subs)
    phase = runner.prepare(env.live(), subs, torch.arange(n))
    kernel.out_cache_loc = phase.forward_batch.out_cache_loc
    q = torch.randn(n, HEADS * DIM)
    k = torch.randn(n, KV_HEADS, DIM)
    backend.forward_extend(q, k, torch.randn_like(k), env.layer, phase.forward_batch)
    assert len(kernel.plans) == 1
    qo_lens, kv_lens = kernel.plans[0]
    assert qo_lens == [s.extend for s in subs]
    assert kv_lens == [s.prefix + s.extend for s in subs]
    # FA3's tile for head_dim 16 on sm90: 192 rows, KV in 128-token blocks.
    assert kv_reads.fa3_tile(SHAPE) == kv_reads.TilePlan(192, SHAPE.group, 128)
    assert brute_reads(qo_lens, kv_lens, 192, 128) == model_reads(env, "fa3")
