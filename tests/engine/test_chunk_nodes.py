"""ChunkNodeTable: chunk-hashed nodes holding slots of a (fake) token-to-KV allocator.

No SGLang needed: ``FakeAllocator`` tracks every slot, so a leak or a double free fails.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.keys import ModelFingerprint
from tests.support.fakes import FakeAllocator, FakePool

FP = ModelFingerprint(model_id="test-model", dtype="float32")
SEG = 4


def make_table(
    capacity: int = 64, page_size: int = 1, pages: int = 64, seg: int = SEG, policy: str = "lru"
) -> tuple[ChunkNodeTable, FakeAllocator]:
    alloc = FakeAllocator(pages, page_size)
    return ChunkNodeTable(alloc, FP, seg, capacity, policy), alloc


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def held(table: ChunkNodeTable, tokens: list[int]) -> list[bool]:
    return [table.contains(k.digest) for k in table.keys(tokens)]


def assert_released(table: ChunkNodeTable, alloc: FakeAllocator) -> None:
    table.clear(free=True)
    assert len(table) == 0 and table.allocated_tokens == 0
    assert alloc.free_slots() == alloc.initial_free and not alloc.allocated


# --------------------------------------------------------------------- hits
def test_hit_needs_every_segment_held() -> None:
    table, alloc = make_table()
    x = toks(100, 10)  # segments of 4, 4, 2
    out = table.insert(x, None)
    assert out is not None and len(out[0]) == 3
    hit = table.match(x)
    assert hit is not None and [n.key for n in hit.nodes] == [k.digest for k in table.keys(x)]
    # A segment-aligned prefix of the chunk is held too: same chained keys.
    prefix = table.match(x[:8])
    assert prefix is not None and prefix.nodes == hit.nodes[:2]
    # Dropping the last segment (the only leaf) makes the whole chunk miss.
    assert table.evict(1) == 2
    assert held(table, x) == [True, True, False]
    assert table.match(x) is None
    assert table.match(x[:8]) is not None
    assert table.match(toks(100, 9)) is None  # never inserted: a 1-token last segment
    assert_released(table, alloc)


def test_keys_chain_over_earlier_segments() -> None:
    table, alloc = make_table()
    a, b = toks(0, 4), toks(10, 4)
    x = a + b
    table.insert(x, None)
    changed_first = [99] + a[1:] + b  # second segment's tokens unchanged
    assert table.keys(changed_first)[1].digest != table.keys(x)[1].digest
    assert table.match(changed_first) is None
    out = table.insert(changed_first, None)
    assert out is not None and len(out[0]) == 2  # nothing shared, not even the 2nd segment
    # Same first segment, other second one: the first node is shared and is the parent.
    z = a + toks(20, 4)
    out = table.insert(z, None)
    assert out is not None
    nodes, keys = out
    assert len(nodes) == 1 and keys[0].start == 4
    assert nodes[0].parent == table.keys(x)[0].digest
    hit_x, hit_z = table.match(x), table.match(z)
    assert hit_x is not None and hit_z is not None
    assert hit_x.nodes[0] is hit_z.nodes[0] and hit_x.nodes[1] is not hit_z.nodes[1]
    assert_released(table, alloc)


def test_insert_returns_the_nodes_to_fill_and_match_returns_their_slots() -> None:
    table, alloc = make_table()
    pool = FakePool(alloc.size + 1, num_layers=1, heads=1, head_dim=1)
    x = toks(7, 11)
    free_before = alloc.free_slots()
    out = table.insert(x, None)
    assert out is not None
    nodes, keys = out
    assert [k.digest for k in keys] == [k.digest for k in table.keys(x)]
    assert [n.key for n in nodes] == [k.digest for k in keys]
    slots = torch.cat([n.kv_slots for n in nodes])
    assert slots.numel() == len(x) == len(set(slots.tolist()))
    assert set(slots.tolist()) <= free_before and set(slots.tolist()) <= alloc.allocated
    for node, key in zip(nodes, keys, strict=True):
        assert node.num_tokens == key.end - key.start == node.kv_slots.numel()
        # The caller writes the segment's KV into the node's slots.
        values = torch.tensor(x[key.start : key.end], dtype=torch.float32)
        pool.get_key_buffer(0)[node.kv_slots] = values[:, None, None]
    hit = table.match(x)
    assert hit is not None and torch.equal(hit.slots, slots)
    read = pool.get_key_buffer(0)[hit.slots].flatten()
    assert read.tolist() == [float(t) for t in x]
    # Everything held: nothing new, nothing allocated.
    calls = len(alloc.alloc_sizes)
    assert table.insert(x, None) == ((), ())
    assert len(alloc.alloc_sizes) == calls
    assert_released(table, alloc)


def test_ranking_is_concatenated_or_none() -> None:
    table, alloc = make_table()
    x = toks(0, 8)
    r = torch.arange(8, dtype=torch.float32) / 8
    table.insert(x, r)
    hit = table.match(x)
    assert hit is not None and hit.ranking is not None and torch.equal(hit.ranking, r)
    r[0] = -5.0  # the table kept its own copy
    assert table.match(x).ranking[0].item() == 0.0  # type: ignore[union-attr]
    z = x[:4] + toks(50, 4)  # shares the ranked first segment, second one unranked
    table.insert(z, None)
    hit_z = table.match(z)
    assert hit_z is not None and hit_z.ranking is None
    assert_released(table, alloc)


# --------------------------------------------------------------------- pages
def test_page_padding() -> None:
    table, alloc = make_table(page_size=4, pages=16, seg=8)
    out = table.insert(toks(0, 10), None)  # segments of 8 and 2
    assert out is not None
    nodes, _ = out
    assert alloc.alloc_sizes == [12]
    assert [n.allocated for n in nodes] == [8, 4]
    assert [n.kv_slots.numel() for n in nodes] == [8, 2]
    for n in nodes:
        s = n.slots.tolist()
        assert s[0] % 4 == 0 and s == list(range(s[0], s[0] + n.allocated))  # whole pages
    assert table.allocated_tokens == 12 and len(alloc.allocated) == 12
    out = table.insert(toks(100, 3), None)
    assert out is not None and out[0][0].allocated == 4 and out[0][0].kv_slots.numel() == 3
    assert alloc.alloc_sizes == [12, 4]
    assert table.allocated_tokens == 16
    assert table.evict(1) == 4  # the oldest leaf, a whole padded page
    assert_released(table, alloc)


def test_capacity_counts_padded_slots() -> None:
    table, alloc = make_table(capacity=8, page_size=4, pages=16, seg=8)
    assert table.insert(toks(0, 5), None) is not None  # 8 slots
    b = toks(100, 1)
    assert table.insert(b, None) is not None  # 4 more: evicts the first
    assert table.allocated_tokens == 4 and len(table) == 1 and table.match(b) is not None
    assert table.insert(toks(200, 9), None) is None  # 12 padded slots > capacity 8
    assert_released(table, alloc)


# --------------------------------------------------------------------- capacity
def test_insert_beyond_capacity_evicts_lru_unlocked_leaves() -> None:
    table, alloc = make_table(capacity=12)
    a, b, c, d = toks(0, 4), toks(10, 4), toks(20, 4), toks(30, 4)
    for t in (a, b, c):
        assert table.insert(t, None) is not None
    assert table.allocated_tokens == 12
    table.match(a)  # a is now more recent than b and c
    b_slots = set(table.match(b).slots.tolist())  # type: ignore[union-attr]
    table.match(c)
    table.match(a)
    # LRU order now: b, c, a.
    assert table.insert(d, None) is not None
    assert table.match(b) is None
    assert all(table.match(t) is not None for t in (a, c, d))
    assert table.allocated_tokens == 12
    assert b_slots <= alloc.free_slots()
    assert_released(table, alloc)


def test_insert_gives_up_when_only_locked_nodes_remain() -> None:
    table, alloc = make_table(capacity=8)
    a, b = toks(0, 4), toks(10, 4)
    table.insert(a, None)
    table.insert(b, None)
    for t in (a, b):
        hit = table.match(t)
        assert hit is not None
        table.lock(hit.nodes)
    free_before, calls = alloc.free_slots(), len(alloc.alloc_sizes)
    assert table.insert(toks(20, 4), None) is None
    assert alloc.free_slots() == free_before and len(alloc.alloc_sizes) == calls
    assert len(table) == 2 and table.protected_tokens == 8 and table.evictable_tokens == 0
    assert table.match(a) is not None and table.match(b) is not None
    # Larger than the whole capacity: refused outright.
    assert table.insert(toks(40, 9), None) is None
    assert len(alloc.alloc_sizes) == calls
    for t in (a, b):
        table.unlock(table.match(t).nodes)  # type: ignore[union-attr]
    assert table.insert(toks(20, 4), None) is not None
    assert_released(table, alloc)


def test_insert_fails_cleanly_when_the_allocator_is_exhausted() -> None:
    table, alloc = make_table(capacity=64, pages=6)
    other = alloc.alloc(4)  # a running request holds 4 of the 6 slots
    assert other is not None
    free_before = alloc.free_slots()
    assert table.insert(toks(0, 4), None) is None
    assert len(table) == 0 and table.allocated_tokens == 0 and alloc.free_slots() == free_before
    assert table.insert(toks(0, 2), None) is not None
    alloc.free(other)
    assert_released(table, alloc)


def test_zero_capacity_holds_nothing() -> None:
    table, alloc = make_table(capacity=0)
    assert table.insert(toks(0, 1), None) is None
    assert alloc.alloc_sizes == []
    with pytest.raises(ValueError):
        ChunkNodeTable(alloc, FP, SEG, -1)


# --------------------------------------------------------------------- eviction
def test_eviction_takes_leaves_from_the_tail_of_a_chunk() -> None:
    table, alloc = make_table()
    x = toks(0, 12)  # three segments
    y = toks(100, 4)
    table.insert(x, None)
    table.insert(y, None)  # more recent than every segment of x
    assert table.evict(1) == 4
    assert held(table, x) == [True, True, False] and table.match(y) is not None
    table.match(x[:8])  # touching the first two: y is now the oldest leaf
    assert table.evict(1) == 4
    assert table.match(y) is None and held(table, x) == [True, True, False]
    assert table.evict(1) == 4
    assert held(table, x) == [True, False, False]
    assert table.evict(100) == 4 and len(table) == 0
    assert table.evict(100) == 0
    assert_released(table, alloc)


def churn(policy: str, rounds: int = 6) -> tuple[int, int, int]:
    """Two hot chunks used every round; between rounds, more novel chunks than the table
    holds. (hot hits, evicted nodes, novel chunks of the last round still held)."""
    table, alloc = make_table(capacity=24, policy=policy)  # six one-segment chunks
    hot = [toks(1000, 4), toks(2000, 4)]

    def use(t: list[int]) -> bool:
        if table.match(t) is not None:
            return True
        assert table.insert(t, None) is not None
        return False

    for _ in range(3):
        for t in hot:
            use(t)
    hits = 0
    last: list[list[int]] = []
    for r in range(rounds):
        last = [toks(10 * (8 * r + i), 4) for i in range(8)]
        for t in last:
            assert not use(t)
        hits += sum(use(t) for t in hot)
    novel_held = sum(table.match(t) is not None for t in last)
    evicted = table.eviction.evicted
    assert_released(table, alloc)
    return hits, evicted, novel_held


def test_gdsf_keeps_hot_chunks_through_a_churn_of_novel_ones() -> None:
    gdsf_hits, gdsf_evicted, gdsf_novel = churn("gdsf")
    lru_hits, lru_evicted, _ = churn("lru")
    assert lru_hits == 0 and gdsf_hits == 2 * 6
    assert gdsf_novel == 4  # novel chunks still come in, into the room the hot ones leave
    # LRU evicts the hot chunks too, and recomputes them every round.
    assert lru_evicted == gdsf_evicted + 2 * 6


def test_gdsf_evicts_leaves_only_and_ages_out_an_unused_chunk() -> None:
    table, alloc = make_table(capacity=16, policy="gdsf")
    x = toks(0, 8)  # two segments: the first is the second's parent
    table.insert(x, None)
    for _ in range(4):
        table.match(x)
    survived = 0
    for i in range(40):
        table.insert(toks(100 + 10 * i, 4), None)
        if held(table, x) != [True, True]:
            break
        survived += 1
    # The tail segment went first (leaves only), after several turnovers of the table.
    assert held(table, x) == [True, False]
    assert 4 <= survived < 40
    assert_released(table, alloc)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_table(policy="mru")


def test_eviction_never_drops_a_locked_node_or_its_predecessors() -> None:
    table, alloc = make_table()
    x, y = toks(0, 12), toks(100, 4)
    table.insert(x, None)
    table.insert(y, None)
    hit = table.match(x[:8])  # locks the first two segments only
    assert hit is not None
    table.lock(hit.nodes)
    assert table.protected_tokens == 8 and table.evictable_tokens == 8
    assert table.evict(1000) == 8
    assert held(table, x) == [True, True, False] and table.match(y) is None
    assert table.evict(1000) == 0
    table.unlock(hit.nodes)
    table.lock(hit.nodes[1:])  # only the second segment: its parent has a child
    assert table.evict(1000) == 0 and held(table, x[:8]) == [True, True]
    table.unlock(hit.nodes[1:])
    assert table.evict(1000) == 8
    assert_released(table, alloc)


def test_evict_zero_frees_nothing() -> None:
    table, alloc = make_table()
    table.insert(toks(0, 4), None)
    assert table.evict(0) == 0 and len(table) == 1
    assert_released(table, alloc)


# --------------------------------------------------------------------- locking
def test_lock_counts_each_node_once_and_unlock_beyond_lock_raises() -> None:
    table, alloc = make_table(page_size=2, pages=32)
    x = toks(0, 7)  # 4 + 3 tokens -> 4 + 4 slots
    table.insert(x, None)
    hit = table.match(x)
    assert hit is not None
    table.lock(hit.nodes)
    table.lock(hit.nodes)
    assert table.protected_tokens == 8 and table.evictable_tokens == 0
    table.unlock(hit.nodes)
    assert table.protected_tokens == 8
    table.unlock(hit.nodes)
    assert table.protected_tokens == 0 and table.evictable_tokens == 8
    with pytest.raises(RuntimeError, match="unlocked more than locked"):
        table.unlock(hit.nodes)
    assert table.protected_tokens == 0
    assert_released(table, alloc)


# --------------------------------------------------------------------- clear
def test_clear_frees_every_slot_once() -> None:
    table, alloc = make_table(page_size=4, pages=32)
    for i in range(5):
        table.insert(toks(10 * i, 3 + i), torch.rand(3 + i))
    assert table.allocated_tokens == len(alloc.allocated) > 0
    hit = table.match(toks(0, 3))
    assert hit is not None
    table.lock(hit.nodes)
    nodes = len(table)
    with pytest.raises(RuntimeError):
        table.clear(free=True)
    assert len(table) == nodes == 8 and alloc.freed_slots == 0  # refused: nothing dropped
    table.unlock(hit.nodes)
    held_slots = table.allocated_tokens
    table.clear(free=True)
    assert alloc.freed_slots == held_slots
    assert alloc.free_slots() == alloc.initial_free
    assert len(table) == 0 and table.evictable_tokens == 0 and table.protected_tokens == 0


def test_clear_without_freeing_leaves_the_allocator_alone() -> None:
    table, alloc = make_table()
    table.insert(toks(0, 6), None)
    allocated = alloc.allocated
    table.clear(free=False)  # flush_cache: the allocator is reset next
    assert len(table) == 0 and table.allocated_tokens == 0
    assert alloc.allocated == allocated and alloc.freed_slots == 0
    assert table.match(toks(0, 6)) is None


# ------------------------------------------------- insert under eviction pressure
def test_insert_does_not_evict_the_chunks_own_held_segments() -> None:
    table, alloc = make_table(capacity=8)
    x, z = toks(10, 8), toks(50, 4)
    table.insert(x, None)
    assert table.evict(4) == 4  # x's second segment goes; its first stays, now a leaf
    table.insert(z, None)
    table.match(z)  # x's first segment is the least recently used leaf
    assert table.insert(x, None) is not None  # reported as inserted ...
    assert table.match(x) is not None  # ... so it must hit


def test_every_evictable_node_can_be_evicted() -> None:
    table, alloc = make_table(capacity=8)
    x, z = toks(10, 8), toks(50, 4)
    table.insert(x, None)
    table.evict(4)
    table.insert(z, None)
    table.match(z)
    table.insert(x, None)  # orphans x's second segment (see the test above)
    table.insert(x, None)  # re-inserts the first segment (evicting z)
    table.evict(4)  # the orphan goes: its parent's count of children drops below 0
    assert table.evictable_tokens == 4
    assert table.evict(100) == 4


def test_failed_insert_changes_nothing() -> None:
    table, alloc = make_table(capacity=8)
    a, b = toks(0, 4), toks(10, 4)
    table.insert(a, None)
    table.insert(b, None)
    table.lock(table.match(a).nodes)  # type: ignore[union-attr]
    assert table.insert(toks(20, 8), None) is None  # 8 needed, only b's 4 could go
    assert table.match(b) is not None


def test_discarded_new_nodes_give_their_slots_back_and_leave_held_ones() -> None:
    table, alloc = make_table()
    a = toks(0, 4)
    table.insert(a, None)
    free = alloc.free_slots()
    out = table.insert(a + toks(40, 9), None)  # a held; three new segments after it
    assert out is not None and len(out[0]) == 3
    table.discard(out[0])
    assert alloc.free_slots() == free and table.allocated_tokens == 4
    assert table.match(a + toks(40, 9)) is None and table.match(a) is not None
    assert table.evictable_tokens == 4 and table.evict(100) == 4  # a is a leaf again
    assert_released(table, alloc)


# --------------------------------------------------------------------- random walk
PREFIXES = (toks(1, 4), toks(5, 4))
MIDDLES = (toks(9, 4), toks(13, 4), toks(17, 4))
TAILS = ((21,), (22, 23), (24, 25, 26))

chunks = st.builds(
    lambda p, m, t: list(p) + list(m or ()) + list(t or ()),
    st.sampled_from(PREFIXES),
    st.none() | st.sampled_from(MIDDLES),
    st.none() | st.sampled_from(TAILS),
)


class ChunkTableMachine(RuleBasedStateMachine):
    """Random inserts, hits locked and released, evictions, and other users of the
    allocator; the sizes, the allocator and the locks must agree after every step."""

    page_size = 1
    pages = 24
    capacity = 20

    def __init__(self) -> None:
        super().__init__()
        self.alloc = FakeAllocator(self.pages, self.page_size)
        self.table = ChunkNodeTable(self.alloc, FP, SEG, self.capacity)
        self.holds: list[tuple] = []
        self.external: list[torch.Tensor] = []

    @rule(tokens=chunks, ranked=st.booleans())
    def insert(self, tokens: list[int], ranked: bool) -> None:
        taken = {s for slots in self.external for s in slots.tolist()}
        taken |= {s for nodes in self.holds for n in nodes for s in n.slots.tolist()}
        was_held = {k.digest for k in self.table.keys(tokens) if self.table.contains(k.digest)}
        out = self.table.insert(tokens, torch.rand(len(tokens)) if ranked else None)
        if out is None:
            return
        nodes, keys = out
        assert [n.key for n in nodes] == [k.digest for k in keys]
        assert not {k.digest for k in keys} & was_held
        for n, k in zip(nodes, keys, strict=True):
            assert n.num_tokens == k.end - k.start == n.kv_slots.numel()
            assert n.allocated % self.page_size == 0 and n.allocated >= n.num_tokens
            # Fresh slots (free before, or freed by the insert's own eviction): none
            # another user or a locked node holds.
            assert set(n.slots.tolist()) <= self.alloc.allocated - taken
            assert self.table.contains(n.key)

    @rule(tokens=chunks)
    def lock_hit(self, tokens: list[int]) -> None:
        hit = self.table.match(tokens)
        if hit is None:
            return
        assert torch.equal(hit.slots, torch.cat([n.kv_slots for n in hit.nodes]))
        self.table.lock(hit.nodes)
        self.holds.append(hit.nodes)

    @precondition(lambda self: self.holds)
    @rule(i=st.integers(0, 63))
    def unlock(self, i: int) -> None:
        self.table.unlock(self.holds.pop(i % len(self.holds)))

    @rule(n=st.integers(0, 24))
    def evict(self, n: int) -> None:
        before = self.alloc.freed_slots
        freed = self.table.evict(n)
        assert freed == self.alloc.freed_slots - before
        assert freed >= 0 and (n > 0 or freed == 0)

    @rule()
    def other_alloc(self) -> None:
        slots = self.alloc.alloc(2 * self.page_size)
        if slots is not None:
            self.external.append(slots)

    @precondition(lambda self: self.external)
    @rule()
    def other_free(self) -> None:
        self.alloc.free(self.external.pop(0))

    @invariant()
    def accounting(self) -> None:
        t = self.table
        assert t.evictable_tokens + t.protected_tokens == t.allocated_tokens
        assert 0 <= t.allocated_tokens <= t.capacity_tokens
        external = sum(int(s.numel()) for s in self.external)
        assert len(self.alloc.allocated) == t.allocated_tokens + external
        locked = {id(n): n for nodes in self.holds for n in nodes}
        assert t.protected_tokens == sum(n.allocated for n in locked.values())
        for n in locked.values():
            assert t.contains(n.key)
            assert set(n.slots.tolist()) <= self.alloc.allocated

    def teardown(self) -> None:
        for nodes in self.holds:
            self.table.unlock(nodes)
        assert self.table.protected_tokens == 0
        self.table.clear(free=True)
        for slots in self.external:
            self.alloc.free(slots)
        assert self.alloc.free_slots() == self.alloc.initial_free
        assert not self.alloc.allocated


class PagedChunkTableMachine(ChunkTableMachine):
    page_size = 4
    pages = 7
    capacity = 24


class TenantChunkTableMachine(ChunkTableMachine):
    """The same with a per-namespace cap, inserts into two namespaces, and deletions (a
    locked node deleted leaves the index, and its slots return when it is unlocked)."""

    cap = 12

    def __init__(self) -> None:
        super().__init__()
        self.table = ChunkNodeTable(
            self.alloc, FP, SEG, self.capacity, namespace_max_tokens=self.cap
        )

    @rule(tokens=chunks, ns=st.sampled_from(["a", "b"]))
    def insert_in(self, tokens: list[int], ns: str) -> None:
        self.table.insert(tokens, None, ns)

    @rule(tokens=chunks, ns=st.sampled_from(["a", "b"]))
    def lock_hit_in(self, tokens: list[int], ns: str) -> None:
        hit = self.table.match(tokens, ns)
        if hit is not None:
            self.table.lock(hit.nodes)
            self.holds.append(hit.nodes)

    @rule(ns=st.sampled_from(["", "a", "b"]), tokens=st.none() | chunks)
    def delete(self, ns: str, tokens: list[int] | None) -> None:
        from sgl_pic.store.deletion import Deletion, segment_contents

        contents = None if tokens is None else segment_contents(tokens, SEG)
        self.table.delete(Deletion(namespaces=frozenset({ns}), contents=contents))
        if tokens is not None:
            assert self.table.match(tokens, ns) is None

    @invariant()
    def accounting(self) -> None:
        t = self.table
        assert t.evictable_tokens + t.protected_tokens == t.allocated_tokens
        by_ns = t.tokens_by_namespace()
        assert sum(by_ns.values()) == t.allocated_tokens
        assert all(0 < v <= self.cap for v in by_ns.values())
        external = sum(int(s.numel()) for s in self.external)
        assert len(self.alloc.allocated) == t.allocated_tokens + external
        locked = {id(n): n for nodes in self.holds for n in nodes}
        assert t.protected_tokens == sum(n.allocated for n in locked.values())
        for n in locked.values():
            # A deleted node is out of the index (its key may be a new node's by now).
            assert n.deleted or t.contains(n.key)
            assert set(n.slots.tolist()) <= self.alloc.allocated


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestChunkTable = ChunkTableMachine.TestCase
TestChunkTable.settings = _machine_settings
TestPagedChunkTable = PagedChunkTableMachine.TestCase
TestPagedChunkTable.settings = _machine_settings
TestTenantChunkTable = TenantChunkTableMachine.TestCase
TestTenantChunkTable.settings = _machine_settings


def test_chunk_nodes_whose_kv_could_not_be_written_are_taken_back() -> None:
    """``NodeWriter.write`` links a missed chunk's nodes, then writes their KV; when the
    write fails, the nodes go, or a later device hit would copy unwritten slots."""
    from types import SimpleNamespace

    from sgl_pic.engine.phase1 import NodeWriter

    table, alloc = make_table()
    free = alloc.free_slots()

    def fail(*_args: object) -> None:
        raise ValueError("the pool refused these rows")

    writer = NodeWriter(table, SimpleNamespace(write_rotated=fail), lambda: None)  # type: ignore[arg-type]
    x = toks(3, 9)
    with pytest.raises(ValueError, match="refused"):
        writer.write(tuple(x), torch.zeros(1, 2, len(x), 1, 1), None)
    assert table.match(x) is None and len(table) == 0 and alloc.free_slots() == free


# --------------------------------------------------------------------- deletion
def test_delete_by_namespace_leaves_other_namespaces() -> None:
    from sgl_pic.store.deletion import Deletion

    table, alloc = make_table()
    x = toks(100, 10)
    assert table.insert(x, None, "a") and table.insert(x, None, "b")
    rep = table.delete(Deletion(namespaces=frozenset({"a"})))
    assert (rep.records, rep.tokens, rep.pending_tokens) == (3, 10, 0)
    assert table.match(x, "a") is None and table.match(x, "b") is not None
    assert table.allocated_tokens == 10 and len(alloc.free_slots()) == len(alloc.initial_free) - 10
    assert_released(table, alloc)


def test_delete_by_content_takes_the_chain_after_a_deleted_segment() -> None:
    from sgl_pic.store.deletion import Deletion, segment_contents

    table, alloc = make_table()
    x, y = toks(100, 10), toks(200, 8)
    assert table.insert(x, None) and table.insert(y, None)
    # Only x's first segment named: its successors could never hit again, so they go too.
    rep = table.delete(Deletion(contents=segment_contents(x[:4], SEG)))
    assert rep.records == 3 and table.match(x) is None and table.match(y) is not None
    assert not any(held(table, x)) and table.allocated_tokens == 8
    assert table.delete(Deletion(contents=segment_contents(y, SEG))).records == 2
    assert len(table) == 0 and alloc.free_slots() == alloc.initial_free


def test_a_locked_node_leaves_the_index_at_once_and_frees_its_slots_when_unlocked() -> None:
    from sgl_pic.store.deletion import Deletion

    table, alloc = make_table()
    x = toks(100, 10)
    assert table.insert(x, None, "a")
    hit = table.match(x, "a")
    assert hit is not None
    table.lock(hit.nodes)  # a running request copies them out
    rep = table.delete(Deletion(namespaces=frozenset({"a"})))
    assert (rep.records, rep.pending_tokens) == (3, 10)
    assert table.match(x, "a") is None and len(table) == 0
    # Still the request's: protected, not evictable, not back in the allocator.
    assert table.protected_tokens == 10 and table.evictable_tokens == 0
    assert len(alloc.free_slots()) == len(alloc.initial_free) - 10
    # A new copy of the same chunk is computed afresh into new slots.
    again = table.insert(x, None, "a")
    assert again is not None and len(again[0]) == 3
    table.unlock(hit.nodes)
    assert table.protected_tokens == 0 and table.allocated_tokens == 10
    assert len(alloc.free_slots()) == len(alloc.initial_free) - 10
    assert_released(table, alloc)


def test_a_deletion_stops_promotions_under_way() -> None:
    from sgl_pic.store.deletion import Deletion

    table, _ = make_table()
    before = table.generation
    table.delete(Deletion(namespaces=frozenset({"nobody"})))
    assert table.generation == before + 1


# --------------------------------------------------------------------- fair share
@pytest.mark.parametrize("policy", ["lru", "lfu", "gdsf"])
@pytest.mark.parametrize("capacity", [48, 32])  # room for both caps; room for less
def test_one_namespaces_churn_never_evicts_anothers_within_its_cap(
    policy: str, capacity: int
) -> None:
    alloc = FakeAllocator(64)
    table = ChunkNodeTable(alloc, FP, SEG, capacity, policy, namespace_max_tokens=24)
    quiet = [toks(1000 + 10 * i, 4) for i in range(4)]  # 16 slots, within the cap of 24
    for x in quiet:
        assert table.insert(x, None, "quiet")
    for i in range(200):  # churn: novel chunks, far past the cap and the capacity
        assert table.insert(toks(5000 + 10 * i, 4), None, "busy") is not None
        assert table.tokens_by_namespace()["busy"] <= 24
        if i % 7 == 0:
            table.match(toks(5000 + 10 * i, 4), "busy")  # some of its own come back
    assert all(table.match(x, "quiet") is not None for x in quiet)
    assert table.tokens_by_namespace() == {"quiet": 16, "busy": min(24, capacity - 16)}
    assert_released(table, alloc)


@pytest.mark.parametrize("policy", ["lru", "lfu", "gdsf"])
def test_a_full_table_takes_the_inserters_multi_segment_chunks_before_anothers(
    policy: str,
) -> None:
    """Evicting a chunk's last segment exposes the one before it as a leaf: the inserting
    namespace's whole chunk goes before another namespace's leaves within its cap."""
    alloc = FakeAllocator(100)
    table = ChunkNodeTable(alloc, FP, SEG, 5 * SEG, policy, namespace_max_tokens=5 * SEG)
    assert table.insert(toks(100, 3 * SEG), None, "A")  # one chunk of three segments
    assert table.insert(toks(200, SEG), None, "B") and table.insert(toks(300, SEG), None, "B")
    assert table.insert(toks(400, 2 * SEG), None, "A") is not None
    assert table.tokens_by_namespace() == {"A": 3 * SEG, "B": 2 * SEG}
    assert_released(table, alloc)


def test_without_a_cap_churn_evicts_across_namespaces() -> None:
    alloc = FakeAllocator(64)
    table = ChunkNodeTable(alloc, FP, SEG, 48, "lru")
    quiet = [toks(1000 + 10 * i, 4) for i in range(4)]
    for x in quiet:
        assert table.insert(x, None, "quiet")
    for i in range(40):
        assert table.insert(toks(5000 + 10 * i, 4), None, "busy") is not None
    assert all(table.match(x, "quiet") is None for x in quiet)


def test_a_namespace_at_its_cap_gives_up_its_own_and_never_more_than_it_has() -> None:
    alloc = FakeAllocator(64)
    table = ChunkNodeTable(alloc, FP, SEG, 64, "lru", namespace_max_tokens=8)
    a, b = toks(100, 4), toks(200, 4)
    assert table.insert(a, None, "n") and table.insert(b, None, "n")
    hit = table.match(a, "n")
    assert hit is not None
    table.lock(hit.nodes)  # a running request holds a: only b can make room
    assert table.insert(toks(300, 4), None, "n")
    assert table.match(a, "n") is not None and table.match(b, "n") is None
    # A chunk bigger than the cap is never stored, and nothing is evicted for it.
    assert table.insert(toks(400, 12), None, "n") is None and len(table) == 2
    table.unlock(hit.nodes)
    with pytest.raises(ValueError, match="namespace_max_tokens"):
        ChunkNodeTable(alloc, FP, SEG, 64, namespace_max_tokens=-1)


def test_a_chunk_encoded_after_a_first_chunk_is_its_own_node_and_goes_with_it() -> None:
    from sgl_pic.store.deletion import Deletion, segment_contents

    table, alloc = make_table()
    first, x = toks(100, 10), toks(200, 8)
    context, contents = "c" * 64, tuple(sorted(segment_contents(first, 4)))
    assert table.insert(first, None) and table.insert(x, None, "", context, contents)
    assert table.match(x) is None  # encoded alone, x is another chunk
    assert table.match(x, "", "d" * 64) is None
    assert table.match(x, "", context) is not None
    assert table.insert(x, None)  # stored alone too, beside it
    rep = table.delete(Deletion(contents=segment_contents(first, 4)))
    assert rep.records == 3 + 2  # first's three segments, x's two encoded after it
    assert table.match(x, "", context) is None and table.match(x) is not None
    assert_released(table, alloc)


# --------------------------------------------------------------------- weight updates
def test_rekey_drops_every_node_and_keys_new_chunks_by_the_new_weights() -> None:
    import dataclasses

    table, alloc = make_table()
    x, y = toks(100, 10), toks(200, 8)
    assert table.insert(x, None) and table.insert(y, None)
    hit = table.match(y)
    assert hit is not None
    table.lock(hit.nodes)  # a running request copies y out
    old_keys, generation = table.keys(x), table.generation
    rep = table.rekey(dataclasses.replace(FP, model_id="updated-weights"))
    assert (rep.records, rep.tokens, rep.pending_tokens) == (5, 18, 8)
    assert table.generation == generation + 1  # promotions begun before it are dropped
    assert table.match(x) is None and table.match(y) is None and len(table) == 0
    assert all(a.digest != b.digest for a, b in zip(old_keys, table.keys(x), strict=True))
    table.unlock(hit.nodes)  # the locked node's slots return now
    assert alloc.free_slots() == alloc.initial_free
    assert table.insert(x, None)
    again = table.match(x)
    assert again is not None and again.nodes[0].key != old_keys[0].digest
    assert_released(table, alloc)
