"""Phase batches are ordinary SGLang extend batches: what the attention backend receives
(sequence and prefix lengths, request rows, output slots, positions) is what the plan
says, and torch_native's phase extend equals SGLang's own per-sequence loop on them."""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sgl_pic.binding.attention import row_groups, torch_native_phase_extend
from sgl_pic.binding.phases import PhaseRunner, build_phase_batch
from sgl_pic.core.runs import SubRequest, attended_keys, runs_of

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 16, 256


class Env:
    """A request table with two prompts (rows 1 and 2, ``lengths`` tokens) over shuffled
    pool slots."""

    def __init__(
        self, lengths: tuple[int, int] = (60, 40), slots: int = SLOTS, window: int = -1
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.req_pool = ReqToTokenPool(8, max(128, *lengths), "cpu", False)
        self.pool = MHATokenToKVPool(
            size=slots,
            page_size=1,
            dtype=torch.float32,
            head_num=KV_HEADS,
            head_dim=DIM,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        a, b = lengths
        perm = torch.randperm(slots - 1, generator=g)[: a + b] + 1
        self.rows = self.req_pool.alloc_rows(2)
        self.req_pool.req_to_token[self.rows[0], :a] = perm[:a].int()
        self.req_pool.req_to_token[self.rows[1], :b] = perm[a:].int()
        kb = self.pool.get_key_buffer(0)
        kb[:] = torch.randn(kb.shape, generator=g)
        vb = self.pool.get_value_buffer(0)
        vb[:] = torch.randn(vb.shape, generator=g)
        self.backend = TorchNativeAttnBackend(
            SimpleNamespace(
                device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.pool
            )
        )
        self.layer = RadixAttention(
            HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0, sliding_window_size=window
        )
        self.g = g

    def live(self) -> ForwardBatch:
        """A live extend batch: row 0 extends 60 tokens from 0, row 1 20 from 20."""
        ids = torch.arange(80)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=2,
            input_ids=ids,
            req_pool_indices=torch.tensor(self.rows, dtype=torch.int64),
            seq_lens=torch.tensor([60, 40]),
            out_cache_loc=torch.cat(
                [
                    self.req_pool.req_to_token[self.rows[0], :60],
                    self.req_pool.req_to_token[self.rows[1], 20:40],
                ]
            ).long(),
            seq_lens_sum=100,
            extend_prefix_lens_cpu=[0, 20],
            extend_seq_lens_cpu=[60, 20],
            rids=["a", "b"],
        )


def subrequests(env: Env) -> list[SubRequest]:
    # Three runs of row 0 (the chunked request) and row 1 as the plain request it is.
    return [
        SubRequest(env.rows[0], 3, 5),
        SubRequest(env.rows[0], 20, 1),
        SubRequest(env.rows[0], 50, 10),
        SubRequest(env.rows[1], 20, 20),
    ]


def test_phase_batch_is_what_the_plan_says() -> None:
    env = Env()
    subs = subrequests(env)
    ids = torch.arange(36) + 1000
    phase = build_phase_batch(env.live(), subs, ids, env.req_pool.req_to_token, None)
    fb = phase.forward_batch
    table = env.req_pool.req_to_token
    assert fb.forward_mode == ForwardMode.EXTEND and fb.batch_size == 4
    assert fb.req_pool_indices.tolist() == [env.rows[0]] * 3 + [env.rows[1]]
    assert fb.extend_prefix_lens_cpu == [3, 20, 50, 20] == fb.extend_prefix_lens.tolist()
    assert fb.extend_seq_lens_cpu == [5, 1, 10, 20] == fb.extend_seq_lens.tolist()
    assert fb.seq_lens.tolist() == [8, 21, 60, 40] == fb.seq_lens_cpu.tolist()
    assert fb.seq_lens_sum == 129 and fb.extend_num_tokens == 36
    assert fb.extend_start_loc.tolist() == [0, 5, 6, 16]
    expect_pos = list(range(3, 8)) + [20] + list(range(50, 60)) + list(range(20, 40))
    assert fb.positions.tolist() == expect_pos
    expect_loc = torch.cat([table[s.pool_idx, s.prefix : s.prefix + s.extend] for s in subs])
    assert fb.out_cache_loc.tolist() == expect_loc.tolist()
    assert fb.input_ids.tolist() == ids.tolist()
    assert not fb.return_logprob and fb.rids is None and not fb.forward_metadata_ready
    live = env.live()
    before = (live.batch_size, live.input_ids.clone(), live.out_cache_loc.clone(), live.rids)
    build_phase_batch(live, subs, ids, table, None)
    # The live batch SGLang built is left as it was.
    assert live.batch_size == before[0] and live.rids == before[3]
    assert torch.equal(live.input_ids, before[1]) and torch.equal(live.out_cache_loc, before[2])
    assert live.extend_seq_lens_cpu == [60, 20]
    with pytest.raises(ValueError, match="input ids"):
        build_phase_batch(live, subs, ids[:3], table, None)


# FlashInfer, FA3, triton and hybrid backends: SGLang's own classes, in
# ``test_backend_contracts``.


def test_torch_native_puts_no_cap_on_sub_requests() -> None:
    # Past the cap the executor merges runs, and a request's recomputed set would depend
    # on the batch it shares; torch_native has no per-request plan buffers to bound.
    env = Env()
    runner = PhaseRunner(env.backend, env.req_pool.req_to_token, None, env.req_pool)
    assert runner.max_subrequests is None
    planned: list[Any] = []
    other = SimpleNamespace(init_forward_metadata=planned.append)
    assert PhaseRunner(other, env.req_pool.req_to_token, None, env.req_pool).max_subrequests == (
        env.req_pool.size
    )


def test_the_backend_plans_the_phase_batch() -> None:
    env = Env()
    planned: list[Any] = []
    backend = SimpleNamespace(init_forward_metadata=planned.append)
    runner = PhaseRunner(backend, env.req_pool.req_to_token, None, env.req_pool)
    phase = runner.prepare(env.live(), subrequests(env), torch.arange(36))
    assert planned == [phase.forward_batch]
    seen: list[Any] = []

    def stack(ids: torch.Tensor, pos: torch.Tensor, fb: Any) -> torch.Tensor:
        seen.append(runner.batch)
        return torch.zeros(ids.numel(), 3)

    assert runner.run(stack, phase).shape == (36, 3)
    assert seen == [phase.forward_batch] and runner.batch is None
    rows = runner.scratch_rows(2)
    assert rows is not None and len(set(rows) & set(env.rows)) == 0
    free = env.req_pool.available_size()
    runner.free_rows(rows)
    assert env.req_pool.available_size() == free + 2


def test_torch_native_phase_extend_equals_sglangs_loop() -> None:
    env = Env()
    check_against_sglang(env, subrequests(env))


def test_phase_extend_over_several_blocks_and_a_whole_prompt() -> None:
    # Row 0: 300 keys, 200 queries: runs of 4 spread over 240 positions, then a run of 40
    # (cut into three blocks); row 1: a prompt computed from position 0, every key with its
    # query (plain causal attention).
    env = Env(lengths=(300, 30), slots=512)
    subs = [SubRequest(env.rows[0], a, 4) for a in range(0, 240, 6)]
    subs += [SubRequest(env.rows[0], 240, 40), SubRequest(env.rows[1], 0, 30)]
    built = check_against_sglang(env, subs)
    scattered, whole = built
    assert [(b.start, b.end) for b in scattered.blocks] == [(0, 64), (64, 128), (128, 200)]
    for b in scattered.blocks:
        assert b.keys == int(scattered.q_index[b.end - 1]) + 1
        assert b.mask is not None and b.mask.shape == (b.end - b.start, b.keys)
    assert [(b.start, b.end, b.keys, b.mask) for b in whole.blocks] == [(0, 30, 30, None)]


@pytest.mark.parametrize("window", [1, 7, 100])
def test_phase_extend_applies_a_sliding_window_as_sglangs_loop_does(window: int) -> None:
    # Runs spread over a row longer than the window, a run of several blocks, and a plain
    # prompt from position 0: every query sees only the keys SGLang's loop lets it see.
    env = Env(lengths=(300, 30), slots=512, window=window)
    subs = [SubRequest(env.rows[0], a, 4) for a in range(0, 240, 6)]
    subs += [SubRequest(env.rows[0], 240, 40), SubRequest(env.rows[1], 0, 30)]
    check_against_sglang(env, subs)
    env = Env(window=window)
    check_against_sglang(env, subrequests(env))


def check_against_sglang(env: Env, subs: list[SubRequest]) -> list[Any]:
    """torch_native_phase_extend over ``subs`` equals SGLang's loop: the same output and the
    same K/V written; the groups it used (built once for every layer) are returned."""
    n = sum(s.extend for s in subs)
    phase = build_phase_batch(env.live(), subs, torch.arange(n), env.req_pool.req_to_token, None)
    fb = phase.forward_batch
    q = torch.randn(n, HEADS * DIM, generator=env.g)
    k = torch.randn(n, KV_HEADS, DIM, generator=env.g)
    v = torch.randn(n, KV_HEADS, DIM, generator=env.g)
    k_before = env.pool.get_key_buffer(0).clone()
    env.backend.init_forward_metadata(fb)
    runner = PhaseRunner(env.backend, env.req_pool.req_to_token, None, env.req_pool)
    built: list[Any] = []

    def stack(*_: Any) -> torch.Tensor:
        built.append(runner.row_groups())
        built.append(runner.row_groups())  # a later layer gets the same groups, not new ones
        return torch.zeros(0)

    runner.run(stack, phase)
    assert built[0] is built[1] and runner.batch is None
    groups = built[0]
    ours = torch_native_phase_extend(env.backend, q, k, v, env.layer, fb, groups)
    ours_k = env.pool.get_key_buffer(0).clone()
    env.pool.get_key_buffer(0)[:] = k_before
    theirs = env.backend.forward_extend(q, k, v, env.layer, fb)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # Both wrote the new K/V to the runs' slots before attending.
    torch.testing.assert_close(ours_k, env.pool.get_key_buffer(0))
    torch.testing.assert_close(env.pool.get_key_buffer(0)[fb.out_cache_loc], k)
    return groups


def test_row_groups_join_runs_of_one_row() -> None:
    env = Env()
    subs = subrequests(env)
    groups = row_groups(
        [s.pool_idx for s in subs],
        [s.prefix for s in subs],
        [s.extend for s in subs],
        env.req_pool.req_to_token,
    )
    assert [(g.q_start, g.q_end, g.key_slots.numel()) for g in groups] == [
        (0, 16, 60),
        (16, 36, 40),
    ]
    assert groups[0].q_index.tolist() == list(range(3, 8)) + [20] + list(range(50, 60))


def test_attended_keys_count_each_querys_visible_keys() -> None:
    # A whole prompt of 4: 1 + 2 + 3 + 4. Positions 10..11 of a row: 11 + 12. Position 0: 1.
    subs = [SubRequest(1, 0, 4), SubRequest(2, 10, 2), SubRequest(2, 0, 1)]
    assert attended_keys(subs) == 10 + 23 + 1
    by_query = sum(p + 1 for s in subs for p in range(s.prefix, s.prefix + s.extend))
    assert attended_keys(subs) == by_query
    assert attended_keys([]) == 0


def test_runs_cover_the_selection() -> None:
    sel = torch.tensor([0, 1, 2, 7, 8, 30])
    runs = runs_of(sel)
    assert runs == [(0, 3), (7, 9), (30, 31)]
    assert sum(b - a for a, b in runs) == sel.numel()


def test_the_phase_context_is_reset_whatever_ends_the_forward() -> None:
    """Callbacks, batch and row groups of a phase forward exist only inside it: an exception
    raised in the stack (a layer feed's timeout, a probe cutting the pass short) leaves
    nothing behind, and the layer and attention hooks then act on nothing."""
    env = Env()
    backend = SimpleNamespace(init_forward_metadata=lambda _fb: None)
    runner = PhaseRunner(backend, env.req_pool.req_to_token, None, env.req_pool)
    phase = runner.prepare(env.live(), subrequests(env), torch.arange(36))
    calls: list[tuple[str, int]] = []

    def stack(*_: Any) -> torch.Tensor:
        assert runner.context is not None and runner.batch is phase.forward_batch
        runner.row_groups()
        runner.layer_start(0)
        runner.attention_end(0, None, None)
        runner.layer_end(0)
        raise TimeoutError("layer 1 not loaded")

    with pytest.raises(TimeoutError):
        runner.run(
            stack,
            phase,
            before_layer=[lambda i: calls.append(("before", i))],
            after_layer=[lambda i: calls.append(("after", i))],
            after_attention=[lambda i, _m, _q: calls.append(("attention", i))],
        )
    assert calls == [("before", 0), ("attention", 0), ("after", 0)]
    assert runner.context is None and runner.batch is None
    runner.layer_start(1)
    runner.attention_end(1, None, None)
    runner.layer_end(1)
    assert len(calls) == 3  # SGLang's own forwards see no phase callbacks
    with pytest.raises(AssertionError, match="no phase batch"):
        runner.row_groups()
    # The next phase forward starts from nothing: no callbacks or groups of the last one.
    with runner.running(phase) as ctx:
        assert ctx.before_layer == ctx.after_layer == ctx.after_attention == ()
        assert ctx.groups is None
        with pytest.raises(RuntimeError, match="already under way"), runner.running(phase):
            pass
        assert runner.context is ctx  # a refused nested entry leaves the outer one as it was
    assert runner.context is None
