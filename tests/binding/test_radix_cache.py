"""ChunkRadixCache over a real SGLang UnifiedRadixCache (CPU, no server).

Built from SGLang's own ReqToTokenPool, MHATokenToKVPool and token-to-KV allocator
(``TokenToKVPoolAllocator`` for page size 1, ``PagedTokenToKVPoolAllocator`` for 4), with
a ChunkNodeTable on the same allocator. SGLang's scheduler checks
available + evictable + protected == pool size; every test checks it after each step.
"""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

from array import array
from typing import Any

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()  # sgl_kernel / torchvision stand-ins SGLang imports on the CPU

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_pic.binding.radix_cache import ChunkRadixCache
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.keys import ModelFingerprint
from tests.support.sglang_cache import cache_params, kv_pool_and_allocator

FP = ModelFingerprint(model_id="test-model", dtype="float32")
SEG = 4
SIZE = 96

# Tree prefixes (page-aligned for page size 4) and chunks (segments of 4; W pads).
TREE_A = list(range(1000, 1012))  # 12 tokens, left unlocked
TREE_B = list(range(2000, 2008))  # 8 tokens, locked by a "running request"
CHUNK_X = list(range(100, 108))  # two segments
CHUNK_W = list(range(200, 203))  # one segment of 3 tokens
CHUNK_Y = list(range(300, 304))  # one segment, locked


def key(tokens: list[int]) -> RadixKey:
    return RadixKey(array("q", tokens))


class Env:
    def __init__(self, page_size: int, attach: bool = True) -> None:
        self.page_size = page_size
        self.pool, self.alloc = kv_pool_and_allocator(SIZE, page_size)
        self.cache = ChunkRadixCache(cache_params(self.alloc, page_size, 4, 128))
        self.table = ChunkNodeTable(self.alloc, FP, SEG, capacity_tokens=64)
        if attach:
            self.cache.attach(self.table)
        self.conserved()

    def pad(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    # SGLang's own figures, without the chunk nodes.
    def sgl_evictable(self) -> int:
        return UnifiedRadixCache.evictable_size(self.cache)

    def sgl_protected(self) -> int:
        return UnifiedRadixCache.protected_size(self.cache)

    def conserved(self) -> None:
        c = self.cache
        avail = self.alloc.available_size()
        assert avail + c.evictable_size() + c.protected_size() == SIZE
        assert avail + c.full_evictable_size() + c.full_protected_size() == SIZE

    def tree_insert(self, tokens: list[int]) -> None:
        slots = self.alloc.alloc(len(tokens))
        assert slots is not None
        assert self.cache.insert(InsertParams(key=key(tokens), value=slots)).prefix_len == 0
        self.conserved()

    def tree_lock(self, tokens: list[int]):  # noqa: ANN201 - SGLang's TreeLock
        m = self.cache.match_prefix(MatchPrefixParams(key=key(tokens)))
        assert m.device_prefix_len == len(tokens)
        lock = self.cache.lock(m.last_device_node)
        self.conserved()
        return lock

    def chunk_insert(self, tokens: list[int], lock: bool = False):  # noqa: ANN201
        out = self.table.insert(tokens, None)
        assert out is not None and out[0]
        self.conserved()
        if lock:
            hit = self.table.match(tokens)
            assert hit is not None
            self.table.lock(hit.nodes)
            self.conserved()
            return hit.nodes
        return out[0]

    def held(self, tokens: list[int]) -> list[bool]:
        return [self.table.contains(k.digest) for k in self.table.keys(tokens)]

    def populate(self):  # noqa: ANN201
        """Tree: A unlocked, B locked. Chunk nodes: X (2 nodes) and W unlocked, Y locked,
        inserted in the order X, W, Y."""
        self.tree_insert(TREE_A)
        self.tree_insert(TREE_B)
        tree_lock = self.tree_lock(TREE_B)
        self.chunk_insert(CHUNK_X)
        self.chunk_insert(CHUNK_W)
        y_nodes = self.chunk_insert(CHUNK_Y, lock=True)
        return tree_lock, y_nodes


PAGES = pytest.mark.parametrize("page_size", [1, 4])


@PAGES
def test_unattached_cache_is_sglangs(page_size: int) -> None:
    env = Env(page_size, attach=False)
    env.tree_insert(TREE_A)
    env.tree_insert(TREE_B)
    lock = env.tree_lock(TREE_B)
    c = env.cache
    assert c.chunk_nodes is None
    assert (c.evictable_size(), c.protected_size()) == (12, 8)
    assert c.full_evictable_size() == 12 and c.full_protected_size() == 8
    assert "sgl_pic" not in c.available_and_evictable_str()
    assert c.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 12
    env.conserved()
    c.unlock(lock)
    env.conserved()


@PAGES
def test_sizes_fold_in_chunk_nodes(page_size: int) -> None:
    env = Env(page_size)
    tree_lock, y_nodes = env.populate()
    c, t = env.cache, env.table
    chunk_evictable = 8 + env.pad(3)
    assert (env.sgl_evictable(), env.sgl_protected()) == (12, 8)
    assert (t.evictable_tokens, t.protected_tokens) == (chunk_evictable, 4)
    assert c.evictable_size() == c.full_evictable_size() == 12 + chunk_evictable
    assert c.protected_size() == c.full_protected_size() == 8 + 4
    assert env.alloc.available_size() == SIZE - 12 - 8 - chunk_evictable - 4
    t.unlock(y_nodes)
    env.conserved()
    assert c.evictable_size() == 12 + chunk_evictable + 4 and c.protected_size() == 8
    c.unlock(tree_lock)
    env.conserved()
    assert c.evictable_size() == 20 + chunk_evictable + 4 and c.protected_size() == 0
    summary = c.available_and_evictable_str()
    assert f"sgl_pic chunk nodes: 4 holding {chunk_evictable + 4} slots (0 locked)" in summary


@PAGES
def test_evict_takes_sglangs_tree_first(page_size: int) -> None:
    env = Env(page_size)
    tree_lock, y_nodes = env.populate()
    c, t = env.cache, env.table
    nodes = len(t)
    assert c.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 12  # prefix A, whole
    env.conserved()
    assert len(t) == nodes and env.sgl_evictable() == 0
    # Nothing unlocked left in SGLang's tree: the chunk leaves go, oldest first.
    assert c.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 4
    env.conserved()
    assert env.held(CHUNK_X) == [True, False] and env.held(CHUNK_W) == [True]
    res = c.evict(EvictParams(num_tokens=1000))
    env.conserved()
    assert res.num_tokens_evicted == 4 + env.pad(3)
    assert env.held(CHUNK_X) == [False, False] and env.held(CHUNK_W) == [False]
    assert env.held(CHUNK_Y) == [True]  # locked
    assert env.sgl_protected() == 8 and t.protected_tokens == 4
    t.unlock(y_nodes)
    c.unlock(tree_lock)
    assert c.evict(EvictParams(num_tokens=1000)).num_tokens_evicted == 8 + 4
    env.conserved()
    assert env.alloc.available_size() == SIZE and len(t) == 0


@PAGES
def test_evict_asks_chunk_nodes_only_for_the_shortfall(page_size: int) -> None:
    env = Env(page_size)
    env.populate()
    res = env.cache.evict(EvictParams(num_tokens=14))  # 12 from the tree, 2 short
    env.conserved()
    assert res.num_tokens_evicted == 12 + 4  # one whole chunk node
    assert env.held(CHUNK_X) == [True, False] and env.held(CHUNK_W) == [True]


@PAGES
def test_evict_for_alloc_frees_chunk_nodes_until_the_target(page_size: int) -> None:
    env = Env(page_size)
    env.populate()
    c = env.cache
    available = env.alloc.available_size()
    res = c.evict_for_alloc(EvictParams(num_tokens=12 + 6))
    env.conserved()
    # The tree's 12, then X's second segment and W: the first two leaves by age.
    assert env.alloc.available_size() >= available + 18
    assert res.num_tokens_evicted == 12 + 4 + env.pad(3)
    assert env.held(CHUNK_X) == [True, False] and env.held(CHUNK_W) == [False]
    assert env.held(CHUNK_Y) == [True]


@PAGES
def test_evict_for_alloc_leaves_chunk_nodes_when_the_tree_suffices(page_size: int) -> None:
    env = Env(page_size)
    env.populate()
    nodes = len(env.table)
    res = env.cache.evict_for_alloc(EvictParams(num_tokens=5))
    env.conserved()
    assert res.num_tokens_evicted == 12 and len(env.table) == nodes


@PAGES
def test_evict_for_alloc_stops_when_nothing_is_evictable(page_size: int) -> None:
    env = Env(page_size)
    env.populate()
    res = env.cache.evict_for_alloc(EvictParams(num_tokens=10 * SIZE))
    env.conserved()
    assert res.num_tokens_evicted == 12 + 8 + env.pad(3)
    assert env.cache.evictable_size() == 0 and env.held(CHUNK_Y) == [True]


@PAGES
def test_evict_for_alloc_honours_the_reclaim_predicate(page_size: int) -> None:
    env = Env(page_size)
    env.populate()
    nodes = len(env.table)
    available = env.alloc.available_size()
    res = env.cache.evict_for_alloc(
        EvictParams(num_tokens=1),
        allocation_reclaim_satisfied=lambda: env.alloc.available_size() > available,
    )
    env.conserved()
    assert res.num_tokens_evicted == 12 and len(env.table) == nodes
    # Now only chunk nodes can be evicted; they go until the predicate holds.
    want = env.alloc.available_size() + 5
    res = env.cache.evict_for_alloc(
        EvictParams(num_tokens=5),
        allocation_reclaim_satisfied=lambda: env.alloc.available_size() >= want,
    )
    env.conserved()
    assert env.alloc.available_size() >= want
    assert res.num_tokens_evicted == 4 + env.pad(3)
    assert env.held(CHUNK_X) == [True, False] and env.held(CHUNK_W) == [False]
    assert env.held(CHUNK_Y) == [True]


@PAGES
def test_reset_forgets_chunk_nodes_and_flush_clears_the_allocator(page_size: int) -> None:
    env = Env(page_size)
    tree_lock, y_nodes = env.populate()
    env.table.unlock(y_nodes)
    env.cache.unlock(tree_lock)
    env.cache.reset()
    env.alloc.clear()  # flush_cache: the tree, then the allocator
    env.conserved()
    assert len(env.table) == 0 and env.table.allocated_tokens == 0
    assert env.alloc.available_size() == SIZE
    assert env.cache.evictable_size() == 0 and env.cache.protected_size() == 0
    assert env.table.match(CHUNK_X) is None


def test_reset_refuses_while_a_request_holds_chunk_nodes() -> None:
    env = Env(1)
    env.chunk_insert(CHUNK_Y, lock=True)
    with pytest.raises(RuntimeError):
        env.cache.reset()


@PAGES
def test_chunk_node_count_is_reported_when_eviction_or_a_flush_frees_nodes(page_size: int) -> None:
    # The executor refreshes the slots gauge after its batches; SGLang's eviction and
    # /flush_cache free chunk nodes between them, and report it through the callback.
    env = Env(page_size, attach=False)
    seen: list[int] = []
    env.cache.attach(env.table, seen.append)
    tree_lock, y_nodes = env.populate()
    held = env.table.allocated_tokens
    env.cache.evict(EvictParams(num_tokens=5))  # the tree alone: no chunk node freed
    assert seen == []
    env.cache.evict(EvictParams(num_tokens=1))
    assert seen == [held - 4] == [env.table.allocated_tokens]
    env.cache.evict_for_alloc(EvictParams(num_tokens=env.pad(3)))
    assert seen[-1] == env.table.allocated_tokens < held - 4 and len(seen) == 2
    env.table.unlock(y_nodes)
    env.cache.unlock(tree_lock)
    env.cache.reset()
    assert seen[-1] == 0 and len(seen) == 3


@PAGES
def test_a_deletion_evicts_the_unlocked_tree_and_keeps_sglangs_sizes(page_size: int) -> None:
    from sgl_pic.engine.deleter import Deleter
    from sgl_pic.store.deletion import Deletion, segment_contents

    env = Env(page_size)
    tree_lock, y_nodes = env.populate()
    c, t = env.cache, env.table
    nodes_before = len(t)
    report = Deleter(t, c).execute(Deletion(contents=segment_contents(CHUNK_Y, SEG)))
    env.conserved()
    # Prefix A (unlocked) evicted by SGLang's own eviction; B, locked, stays. No chunk
    # node but the one deleted is touched.
    assert report["prefix_tree_evicted_tokens"] == 12
    assert env.sgl_evictable() == 0 and env.sgl_protected() == 8
    assert report["tiers"]["device"] == {"records": 1, "tokens": 4, "pending_tokens": 4}
    assert len(t) == nodes_before - 1 and env.held(CHUNK_Y) == [False]
    # Y is still the running request's until it lets go, then back in the allocator.
    assert t.protected_tokens == 4
    t.unlock(y_nodes)
    env.conserved()
    assert t.protected_tokens == 0 and env.held(CHUNK_X) == [True, True]
    c.unlock(tree_lock)
    env.conserved()


def test_a_node_a_running_request_holds_is_not_matched_after_a_deletion() -> None:
    """SGLang cannot evict a locked node; the deletion's fresh namespace makes it
    unreachable for every later request instead (``gate.namespace``)."""
    from sgl_pic.config import PicConfig
    from sgl_pic.core.gate import namespace
    from sgl_pic.engine.deleter import Deleter
    from sgl_pic.store.deletion import Deletion

    env = Env(1)
    deleter = Deleter(env.table, env.cache)
    old = namespace(PicConfig(), "tenant", generation=deleter.generation)
    slots = env.alloc.alloc(len(TREE_B))
    env.cache.insert(InsertParams(key=RadixKey(array("q", TREE_B), old), value=slots))
    m = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", TREE_B), old)))
    lock = env.cache.lock(m.last_device_node)  # the running request's
    deleter.execute(Deletion(namespaces=frozenset({""})))
    env.conserved()
    assert env.sgl_protected() == len(TREE_B)  # still held
    new = namespace(PicConfig(), "tenant", generation=deleter.generation)
    again = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", TREE_B), new)))
    assert again.device_prefix_len == 0
    # It is there all the same: the old namespace would still match it.
    stale = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", TREE_B), old)))
    assert stale.device_prefix_len == len(TREE_B)
    env.cache.unlock(lock)
    env.conserved()


def sglang_req(rid: str) -> Any:
    """A real SGLang ``Req`` (what the scheduler hands the tree cache)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("i", [1, 2, 3]), SamplingParams())


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_request_that_ends_has_its_marks_dropped(checkpointed: bool) -> None:
    """SGLang releases a finished request's KV through ``on_release`` and an aborted queued
    one's cache state through ``release_aborted_request``; either way the request's id
    reaches ``on_request_done``, so admitted marks of requests that end (with or without an
    extend) do not pile up. A retracted request releases its KV unfinished: it keeps its
    marks, since it comes back."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    env = Env(1, attach=False)
    done: list[str] = []
    env.cache.attach(env.table, on_request_done=done.append)
    retracted = sglang_req("retracted")
    env.cache.on_release(retracted, checkpointed=checkpointed)
    assert done == []
    finished = sglang_req("finished")
    finished.finished_reason = FINISH_LENGTH(3)
    env.cache.on_release(finished, checkpointed=checkpointed)
    aborted = sglang_req("aborted")
    env.cache.release_aborted_request(aborted.cache_request_handle)
    assert done == ["finished", "aborted"]
    env.conserved()


def test_the_scheduler_reaches_the_cache_on_every_abort_path() -> None:
    """SGLang 0.5.23's scheduler drops an aborted request's cache state through
    ``tree_cache.finish(handle, ABORT)``, whose base calls ``release_aborted_request``:
    the hook ``ChunkRadixCache`` drops marks on."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, CacheRequestOutcome

    assert "self.tree_cache.finish(" in inspect.getsource(Scheduler._release_aborted_request)
    env = Env(1, attach=False)
    done: list[str] = []
    env.cache.attach(env.table, on_request_done=done.append)
    assert "finish" not in vars(UnifiedRadixCache) and "finish" in vars(BasePrefixCache)
    req = sglang_req("queued")
    env.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
    env.cache.finish(sglang_req("ok").cache_request_handle, CacheRequestOutcome.SUCCESS)
    assert done == ["queued"]


def test_a_request_queued_across_a_deletion_moves_to_the_fresh_namespace() -> None:
    """A request admitted before a deletion (its tree namespace of the old generation) and
    matched after it neither matches the old namespace's KV nor inserts into it; one that
    already holds KV (mid-way through chunked prefill) keeps its namespace."""
    from sgl_pic.config import PicConfig
    from sgl_pic.core.gate import namespace, restamped
    from sgl_pic.engine.deleter import Deleter
    from sgl_pic.store.deletion import Deletion

    env = Env(1)
    deleter = Deleter(env.table, env.cache)
    env.cache.set_restamp(lambda k: restamped(k, deleter.generation))
    old = namespace(PicConfig(), "tenant", generation=deleter.generation)
    slots = env.alloc.alloc(len(TREE_B))
    env.cache.insert(InsertParams(key=RadixKey(array("q", TREE_B), old), value=slots))
    held = env.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", TREE_B), old)))
    lock = env.cache.lock(held.last_device_node)  # a running request keeps it
    queued, midway = sglang_req("queued"), sglang_req("midway")
    queued.extra_key = midway.extra_key = old
    midway.kv.kv_allocated_len = 4  # holds KV from its first piece
    deleter.execute(Deletion(namespaces=frozenset({""})))
    fresh = namespace(PicConfig(), "tenant", generation=deleter.generation)

    def match(req: Any) -> int:
        params = MatchPrefixParams(key=RadixKey(array("q", TREE_B), req.extra_key), req=req)
        return env.cache.match_prefix(params).device_prefix_len

    assert match(queued) == 0 and queued.extra_key == fresh
    assert match(midway) == len(TREE_B) and midway.extra_key == old
    # Keys that are not a chunked request's tree namespace, or current, never move.
    assert restamped(fresh, deleter.generation) is None
    assert restamped("tenant", deleter.generation) is None
    assert restamped("untrusted-namespace:" + old, deleter.generation) is None
    env.cache.unlock(lock)
    env.conserved()
