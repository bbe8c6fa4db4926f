"""Phase 1 of a first prefill piece within the piece's budget (``engine.piece_budget``):
which misses are encoded and which deferred for a given piece, the rule alone and through
the real ``ChunkExecutor`` on the CPU (the host-sync harness's worker, pieces run as SGLang
cuts them): deferred chunks are computed in context by phase 2 in the pieces where they
lie and are not stored, and the next identical request encodes the next ones."""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sgl_pic.binding.gate import EncodingContext, Pending
from sgl_pic.binding.phases import Run
from sgl_pic.config import PicConfig
from sgl_pic.engine.piece_budget import encode_tokens, piece_budget, within_budget
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.http.spans import PicRequest
from sgl_pic.layout import PromptLayout
from tests.engine.test_host_syncs import CHUNK, HIDDEN, NoMetrics, Server, chunk, dev, question


def _plan(
    lengths: list[int], piece_end: int | None, prefix: int = 0, context: int = 0
) -> RequestPlan:
    """A plan of chunks of ``lengths`` and a 4-token question; ``context``: the end of
    the encoding context (``chunk_context="first_chunk"``), 0 for none."""
    layout = PromptLayout.from_lengths(lengths, 4)
    toks = tuple(range(layout.num_tokens))
    encoding = EncodingContext(context, "ctx", ()) if context else EncodingContext()
    pending = Pending(PicRequest(layout, {}), toks, encoding=encoding)
    return RequestPlan(0, 1, prefix, pending, PicConfig(), piece_end)


def _spans(plan: RequestPlan) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in plan.pending.request.layout.chunks]


def test_a_request_taken_whole_encodes_every_miss() -> None:
    plan = _plan([24, 24, 24], piece_end=None)
    assert piece_budget(plan) is None
    assert within_budget(plan, _spans(plan)) == [True, True, True]
    # Its extend ends at its prompt's end: not a first piece either.
    plan = _plan([24, 24, 24], piece_end=76)
    assert within_budget(plan, _spans(plan)) == [True, True, True]


def test_a_first_piece_encodes_misses_in_prompt_order_while_they_fit() -> None:
    plan = _plan([24, 24, 24, 24], piece_end=50)
    assert piece_budget(plan) == 50
    assert within_budget(plan, _spans(plan)) == [True, True, False, False]
    # The budget is the piece's extend, past the device prefix.
    plan = _plan([24, 24, 24, 24], piece_end=60, prefix=24)
    assert within_budget(plan, _spans(plan)[1:]) == [True, False, False]


def test_none_is_encoded_after_the_first_that_does_not_fit() -> None:
    # A later, shorter miss would fit what is left; prompt order wins, so that a repeat of
    # the prompt finds the earlier ones stored and spends its budget on the next ones.
    plan = _plan([20, 30, 5], piece_end=40)
    assert within_budget(plan, _spans(plan)) == [True, False, False]


def test_the_first_miss_is_encoded_whatever_its_size() -> None:
    plan = _plan([24, 24], piece_end=10)
    assert within_budget(plan, _spans(plan)) == [True, False]
    assert within_budget(plan, []) == []


def test_a_context_computed_with_a_miss_counts_against_the_budget() -> None:
    # Under first_chunk the chunks past the first are encoded after tokens [0, 24): phase 1
    # computes those with each miss unless the device prefix holds them.
    plan = _plan([24, 10, 10], piece_end=40, context=24)
    spans = _spans(plan)
    assert [encode_tokens(plan, s, e) for s, e in spans] == [24, 34, 34]
    assert within_budget(plan, spans) == [True, False, False]
    held = _plan([24, 10, 10], piece_end=44, prefix=24, context=24)
    assert [encode_tokens(held, s, e) for s, e in spans[1:]] == [10, 10]
    assert within_budget(held, spans[1:]) == [True, True]


# ----------------------------------------------------------------------- the executor
class Tally:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, by: int = 1) -> None:
        self.n += by


class Counted(NoMetrics):
    """Keeps the plan stats recorded and the budget deferrals; drops the rest."""

    def __init__(self) -> None:
        self.recorded: list[object] = []
        self.budget_deferred = Tally()

    def record(self, stats: object) -> None:
        self.recorded.append(stats)


class Pieces(Server):
    """The harness's worker, fed one request's prefill pieces as SGLang cuts them: each
    piece's slots allocated when it runs, into the request's own row."""

    def __init__(self) -> None:
        super().__init__("cachetune")
        self.metrics = Counted()
        self.executor.metrics = self.metrics
        self.executor.split.metrics = self.metrics
        self.executor.lookup.forwards.metrics = self.metrics

    def prompt(self, order: list[int], i: int) -> Pending:
        toks = [t for c in order for t in chunk(c)] + question(i)
        layout = PromptLayout.from_lengths([CHUNK] * len(order), len(question(i)))
        return Pending(PicRequest(layout, {}), tuple(toks))

    def serve(self, rid: str, pending: Pending, piece: int) -> list[tuple[Run, ...]]:
        """Runs ``pending`` in pieces of ``piece`` tokens; after each, the phase-2 runs
        carried to the next pieces (over the whole prompt; none after the last)."""
        rows = self.req_pool.alloc_rows(1)
        assert rows is not None
        row, n, runs = rows[0], len(pending.token_ids), []
        for start in range(0, n, piece):
            end = min(n, start + piece)
            slots = self.alloc.alloc(end - start)
            assert slots is not None
            self.req_pool.req_to_token[row, start:end] = slots.to(torch.int32)
            ids = torch.tensor(pending.token_ids[start:end])
            live = ForwardBatch(
                forward_mode=ForwardMode.EXTEND,
                batch_size=1,
                input_ids=dev(ids),
                req_pool_indices=dev(torch.tensor([row], dtype=torch.int64)),
                seq_lens=dev(torch.tensor([end])),
                out_cache_loc=slots,
                seq_lens_sum=end,
                extend_prefix_lens_cpu=[start],
                extend_seq_lens_cpu=[end - start],
                req_pool_indices_cpu=torch.tensor([row], dtype=torch.int64),
                rids=[rid],
            )
            out = self.executor.forward(self.stack, live.input_ids, live, {rid: pending})
            assert out is not None and out.shape == (end - start, HIDDEN)
            runs.append(self.carried_runs(rid))
        assert len(self.executor.split.plans) == 0, "the last piece releases the plan"
        self.req_pool.free_rows(rows)
        return runs

    def carried_runs(self, rid: str) -> tuple[Run, ...]:
        carried = self.executor.split.plans.get(rid)
        return carried.runs if carried is not None else ()

    def stored(self, c: int) -> bool:
        return self.executor.nodes.match(tuple(chunk(c)), "", "") is not None


def test_deferred_chunks_are_computed_in_context_and_not_stored_then_stored_next_time() -> None:
    server = Pieces()
    order = [0, 1, 2, 3]
    # Pieces of 50 tokens: the first encodes chunks 0 and 1 (48 tokens), not 2 and 3.
    first = server.prompt(order, 0)
    runs = server.serve("a", first, 50)
    assert [server.stored(c) for c in order] == [True, True, False, False]
    assert server.metrics.budget_deferred.n == 2
    stats = server.metrics.recorded[-1]
    assert (stats.misses, stats.deferred, stats.encoded_tokens) == (2, 2, 2 * CHUNK)
    # Deferred chunks are recomputed whole, by phase 2, over the pieces they lie in.
    planned = runs[0]
    deferred = set(range(2 * CHUNK, 4 * CHUNK))
    covered = {p for r in planned for p in range(r.start, r.end)}
    assert deferred <= covered
    # The same prompt again: 0 and 1 are hits, its budget goes to 2 and 3.
    server.serve("b", server.prompt(order, 1), 50)
    assert all(server.stored(c) for c in order)
    assert server.metrics.budget_deferred.n == 2
    stats = server.metrics.recorded[-1]
    assert (stats.misses, stats.deferred, stats.device_hits) == (2, 0, 2)


def test_an_unsplit_request_encodes_every_miss() -> None:
    server = Pieces()
    n = 4 * CHUNK + len(question(0))
    server.serve("a", server.prompt([0, 1, 2, 3], 0), n)
    assert all(server.stored(c) for c in range(4))
    assert server.metrics.budget_deferred.n == 0
    assert server.metrics.recorded[-1].misses == 4
