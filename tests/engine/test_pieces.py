"""``PiecePlans``: the scratch row of a request planned whole at its first prefill piece,
carried over its pieces and given back whatever ends it."""

from __future__ import annotations

import pytest
import torch

from sgl_pic.core.runs import Run
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.pieces import PiecePlans, clip
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.rope import default_inv_freq
from tests.support.fakes import FakeAllocator, FakePool

LAYERS, HEADS, DIM = 2, 2, 8


class Rows:
    """Request-table rows as ``PhaseRunner.scratch_rows``/``free_rows`` hand them out
    (SGLang's ``ReqToTokenPool.alloc_rows``: None when too few are free)."""

    def __init__(self, free: list[int]) -> None:
        self.free = list(free)

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give(self, rows: list[int]) -> None:
        assert not set(rows) & set(self.free), "row freed twice"
        self.free += rows


def _pieces(pages: int = 40, page_size: int = 1, rows: int = 2):
    allocator = FakeAllocator(pages, page_size)
    pool = FakePool(allocator.size + page_size, LAYERS, HEADS, DIM)
    table = torch.zeros(4, 64, dtype=torch.int32)
    free_rows = Rows(list(range(2, 2 + rows)))
    evicted: list[int] = []
    kv = KVAccess(pool, LAYERS, ModelRope.plain(default_inv_freq(DIM, 10000.0)))
    plans = PiecePlans(
        table, free_rows.take, free_rows.give, allocator, lambda n: evicted.append(n) or 0, kv
    )
    return plans, allocator, table, pool, free_rows, evicted


def _own_slots(allocator: FakeAllocator, table: torch.Tensor, n: int) -> torch.Tensor:
    """# [n] slots SGLang gave the request's first n positions (row 0)."""
    own = allocator.alloc(n)
    assert own is not None
    table[0, :n] = own.to(torch.int32)
    return own


def test_clip_keeps_the_parts_of_runs_inside_a_piece() -> None:
    runs = [Run(0, 3), Run(5, 9), Run(12, 13)]
    assert clip(runs, 2, 6) == [Run(2, 3), Run(5, 6)]
    assert clip(runs, 9, 12) == []
    assert clip(runs, 0, 20) == runs


def test_a_reservation_holds_the_requests_slots_then_scratch_past_its_first_piece() -> None:
    plans, allocator, table, _, rows, _ = _pieces()
    own = _own_slots(allocator, table, 10)
    res = plans.reserve(0, 10, 25)
    assert res is not None and res.row == 2 and rows.free == [3]
    assert table[res.row, :10].tolist() == own.tolist()
    scratch = table[res.row, 10:25].tolist()
    assert scratch == res.scratch.tolist() and not set(scratch) & set(own.tolist())
    assert plans.held_tokens == 15
    plans.release(res)
    assert plans.held_tokens == 0 and rows.free == [3, 2]
    assert allocator.allocated == frozenset(own.tolist())


def test_scratch_is_whole_pages() -> None:
    plans, allocator, table, *_ = _pieces(pages=10, page_size=4)
    table[0, :8] = torch.arange(100, 108, dtype=torch.int32)
    res = plans.reserve(0, 8, 18)  # 10 positions past the piece: 3 pages
    assert res is not None and res.scratch.numel() == 12 and plans.held_tokens == 12
    assert allocator.alloc_sizes[-1] == 12


def test_a_first_piece_off_a_page_boundary_is_not_reserved() -> None:
    # Scratch slots start a page of their own; a piece ending mid-page would have a paged
    # backend read its partial page through them.
    plans, allocator, *_ = _pieces(pages=10, page_size=4)
    assert plans.reserve(0, 6, 18) is None
    assert allocator.alloc_sizes == [] and plans.held_tokens == 0


def test_a_later_piece_points_the_scratch_row_at_the_requests_own_slots_again() -> None:
    # Between pieces SGLang inserts the request's KV into its prefix tree; where the tree
    # held a copy it frees the request's slots and points its row at the copy's.
    from types import SimpleNamespace

    from sgl_pic.engine.batch import BatchContext, PieceSpec
    from sgl_pic.engine.piece_steps import SplitRequests
    from sgl_pic.engine.rank_agreement import RankAgreement

    plans, allocator, table, *_ = _pieces()
    _own_slots(allocator, table, 8)
    res = plans.reserve(0, 8, 20)
    assert res is not None
    plans.keep("r", res, [Run(9, 12)])
    table[0, :4] = torch.tensor([30, 31, 32, 33], dtype=torch.int32)  # the tree's copy
    piece = PieceSpec("r", 0, 0, 8, 14, plans.get("r"))
    ctx = BatchContext(None, torch.zeros(6), SimpleNamespace(rids=["r"]), None)  # type: ignore[arg-type]
    SplitRequests(plans, RankAgreement(), SimpleNamespace()).later_pieces({0: piece}, ctx)  # type: ignore[arg-type]
    assert table[res.row, :8].tolist() == table[0, :8].tolist()
    assert table[res.row, 8:20].tolist() == res.scratch[:12].tolist()  # its own past there
    assert ctx.runs[0] == [Run(9, 12)] and ctx.rows[0] == res.row


def test_no_row_or_no_slots_reserves_nothing_and_leaks_nothing() -> None:
    plans, allocator, _, _, rows, evicted = _pieces(pages=8, rows=1)
    assert plans.reserve(0, 4, 20) is None  # 16 slots wanted, 8 free, eviction freed none
    assert evicted == [16] and rows.free == [2] and allocator.allocated == frozenset()
    first = plans.reserve(0, 4, 6)
    assert first is not None
    assert plans.reserve(1, 4, 6) is None  # no second row
    assert plans.held_tokens == 2


def test_a_carried_plan_copies_each_piece_into_the_requests_slots_and_ends_with_the_last() -> None:
    plans, allocator, table, pool, rows, _ = _pieces()
    own = _own_slots(allocator, table, 8)
    res = plans.reserve(0, 8, 20)
    assert res is not None
    plans.keep("r", res, [Run(3, 5), Run(18, 20)])
    carried = plans.get("r")
    assert carried is not None and carried.next_start == 8 and carried.runs[1] == Run(18, 20)
    # The scratch row's positions 8..19 hold the request's KV (written by the plan).
    for layer in range(LAYERS):
        for pos in range(8, 20):
            slot = int(table[res.row, pos])
            pool.k_buffer[layer][slot] = pos + 0.5
            pool.v_buffer[layer][slot] = -pos
    # SGLang's second piece, 8..15, in new slots of the request's row.
    piece = allocator.alloc(8)
    assert piece is not None
    table[0, 8:16] = piece.to(torch.int32)
    plans.advance("r", 0, 8, 16)
    for layer in range(LAYERS):
        got_k = pool.k_buffer[layer][piece]
        got_v = pool.v_buffer[layer][piece]
        want = torch.arange(8, 16, dtype=torch.float32)
        assert torch.equal(got_k[:, 0, 0], want + 0.5)  # copied, not moved: same positions
        assert torch.equal(got_v[:, 0, 0], -want)
    assert plans.get("r") is carried and carried.next_start == 16
    last = allocator.alloc(4)
    assert last is not None
    table[0, 16:20] = last.to(torch.int32)
    plans.advance("r", 0, 16, 20)
    assert plans.get("r") is None and len(plans) == 0 and plans.held_tokens == 0
    assert rows.free == [3, 2]
    assert allocator.allocated == frozenset(own.tolist() + piece.tolist() + last.tolist())


def test_dropping_an_unknown_request_does_nothing_and_dropping_twice_frees_once() -> None:
    plans, allocator, table, *_ = _pieces()
    res = plans.reserve(0, 2, 6)
    assert res is not None
    plans.keep("r", res, [])
    plans.drop("other")
    plans.drop("r")
    plans.drop("r")  # the allocator raises on a double free
    assert plans.held_tokens == 0 and allocator.allocated == frozenset()


def test_forget_all_gives_nothing_back() -> None:
    # SGLang's flush reset the allocator itself: freeing into it again would be a double
    # free there.
    plans, allocator, *_ = _pieces()
    res = plans.reserve(0, 2, 6)
    assert res is not None
    plans.keep("r", res, [])
    plans.forget_all()
    assert len(plans) == 0 and plans.held_tokens == 0
    assert allocator.allocated == frozenset(res.scratch.tolist())


@pytest.mark.parametrize("page_size", [1, 4])
def test_held_tokens_count_whole_pages(page_size: int) -> None:
    plans, *_ = _pieces(pages=20, page_size=page_size)
    res = plans.reserve(0, 4, 9)
    assert res is not None and plans.held_tokens == res.scratch.numel()
    assert plans.held_tokens % page_size == 0
