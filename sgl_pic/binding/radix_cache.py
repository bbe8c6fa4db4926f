"""The ``sgl_pic`` radix cache: SGLang's own prefix tree plus chunk-hashed, non-prefix nodes.

Prefix matching, insertion and locking of ordinary nodes are SGLang's, untouched, so a
prompt without chunk marks behaves exactly as with SGLang's prefix caching. The chunk nodes
(``ChunkNodeTable``) hold slots of the same allocator, and this class folds them into the
sizes SGLang's scheduler admits and checks against (available + evictable + protected ==
pool size): unlocked chunk slots are evictable, locked ones protected. Eviction asks SGLang's
tree first, then frees chunk leaves, least recently used first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_pic.engine.chunk_nodes import ChunkNodeTable


class ChunkRadixCache(UnifiedRadixCache):
    """``chunk_nodes`` is attached right after construction (``attach``); until then the
    cache is SGLang's unchanged. ``on_chunk_change(allocated_tokens)``, if given, is called
    after SGLang's eviction or a flush frees chunk nodes (between batches, where the
    executor's own count of them is not refreshed). ``on_request_done(rid)``, if given, is
    called when a request ends: SGLang releases a finished request's KV (``on_release``)
    or drops an aborted one's cache state (``release_aborted_request``: aborted while
    queued, refused by the queue limit), so per-request state kept for it elsewhere (its
    admitted marks) goes with it. Both are scheduler side."""

    chunk_nodes: ChunkNodeTable | None = None
    on_chunk_change: Callable[[int], None] | None = None
    on_request_done: Callable[[str], None] | None = None
    restamp: Callable[[str], str | None] | None = None
    held_tokens: Callable[[], int] | None = None
    on_reset: Callable[[], None] | None = None

    def attach(
        self,
        table: ChunkNodeTable,
        on_chunk_change: Callable[[int], None] | None = None,
        on_request_done: Callable[[str], None] | None = None,
    ) -> None:
        self.chunk_nodes = table
        self.on_chunk_change = on_chunk_change
        self.on_request_done = on_request_done

    def set_split_requests(
        self,
        on_request_done: Callable[[str], None],
        held_tokens: Callable[[], int],
        on_reset: Callable[[], None],
    ) -> None:
        """What requests split into prefill pieces need (``engine.pieces``):
        ``on_request_done`` replaces the one ``attach`` set (the runtime's, once built, drops
        marks and carried plans); ``held_tokens()``: slots held for carried plans, reported
        as protected; ``on_reset()``: a flush reset the allocator and request table under
        them. Scheduler side."""
        self.on_request_done = on_request_done
        self.held_tokens = held_tokens
        self.on_reset = on_reset

    def set_restamp(self, restamp: Callable[[str], str | None]) -> None:
        """``restamp(extra_key)``: the request's tree namespace after the deletions executed
        since it was admitted, or None when it is current (``gate.restamped``). Scheduler
        side; read by ``match_prefix``."""
        self.restamp = restamp

    # ------------------------------------------------------------------ matching
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """SGLang's match, after moving a request admitted before a deletion to the
        namespace of the deletions since: a request queued across ``POST /pic/delete``
        never matches tree KV of its old namespace, which a running request may still hold
        or insert. Only a request holding no KV yet moves (its first match, or after a
        retraction released it): one mid-way through chunked prefill keeps the namespace
        its KV is already inserted under. Scheduler side."""
        req = params.req
        # SGLang 0.5.23's Req keeps the KV it holds in ``req.kv`` (``ReqKvInfo``).
        if self.restamp is not None and req is not None and req.kv.kv_allocated_len == 0:
            moved = self.restamp(req.extra_key)
            if moved is not None:
                req.extra_key = moved
                key = params.key
                params = dataclasses.replace(
                    params,
                    key=RadixKey(
                        key.token_ids,
                        extra_key=moved,
                        is_bigram=key.is_bigram,
                        limit=key.limit,
                        cache_salt=key.cache_salt,
                    ),
                )
        return super().match_prefix(params)

    def _changed(self) -> None:
        if self.on_chunk_change is not None and self.chunk_nodes is not None:
            self.on_chunk_change(self.chunk_nodes.allocated_tokens)

    # ----------------------------------------------------------------- request ends
    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        # A retracted request releases its KV too, unfinished: it comes back with its
        # marks (``executor``: resumed).
        if self.on_request_done is not None and req.finished():
            self.on_request_done(req.rid)

    def release_aborted_request(self, request: Any) -> None:
        super().release_aborted_request(request)
        if self.on_request_done is not None:
            self.on_request_done(request.rid)

    # ----------------------------------------------------------------- sizes
    def _chunk_evictable(self) -> int:
        return 0 if self.chunk_nodes is None else self.chunk_nodes.evictable_tokens

    def _chunk_protected(self) -> int:
        held = 0 if self.held_tokens is None else self.held_tokens()
        return held + (0 if self.chunk_nodes is None else self.chunk_nodes.protected_tokens)

    def evictable_size(self) -> int:
        return super().evictable_size() + self._chunk_evictable()

    def full_evictable_size(self) -> int:
        return super().full_evictable_size() + self._chunk_evictable()

    def protected_size(self) -> int:
        return super().protected_size() + self._chunk_protected()

    def full_protected_size(self) -> int:
        return super().full_protected_size() + self._chunk_protected()

    # ----------------------------------------------------------------- eviction
    def evict(self, params: EvictParams) -> EvictResult:
        result = super().evict(params)
        short = params.num_tokens - result.num_tokens_evicted
        if short > 0 and self.chunk_nodes is not None:
            freed = self.chunk_nodes.evict(short)
            result.num_tokens_evicted += freed
            if freed:
                self._changed()
        return result

    def evict_for_alloc(
        self,
        params: EvictParams,
        *,
        allocation_reclaim_satisfied: Callable[[], bool] | None = None,
    ) -> EvictResult:
        target = self.token_to_kv_pool_allocator.available_size() + params.num_tokens
        result = super().evict_for_alloc(
            params, allocation_reclaim_satisfied=allocation_reclaim_satisfied
        )
        if self.chunk_nodes is None:
            return result
        evicted = result.num_tokens_evicted
        while self.chunk_nodes.evictable_tokens > 0:
            if allocation_reclaim_satisfied is not None:
                if allocation_reclaim_satisfied():
                    break
            elif self.token_to_kv_pool_allocator.available_size() >= target:
                break
            short = max(
                self.chunk_nodes.page_size,
                target - self.token_to_kv_pool_allocator.available_size(),
            )
            freed = self.chunk_nodes.evict(short)
            if freed == 0:
                break
            result.num_tokens_evicted += freed
        if result.num_tokens_evicted > evicted:
            self._changed()
        return result

    def evict_prefix_tree(self) -> int:
        """Evicts every unlocked node of SGLang's own tree through its own eviction
        (chunk nodes untouched); the tokens freed. A deletion's way to drop prefix KV
        that may hold deleted chunks (``deleter``)."""
        result = super().evict(EvictParams(num_tokens=super().evictable_size()))
        return int(result.num_tokens_evicted)

    def reset(self) -> None:
        super().reset()
        if self.chunk_nodes is not None:
            # flush_cache clears the allocator right after resetting the tree.
            self.chunk_nodes.clear(free=False)
            self._changed()
        if self.on_reset is not None:
            self.on_reset()

    def available_and_evictable_str(self) -> str:
        base = super().available_and_evictable_str()
        if self.chunk_nodes is None:
            return base
        t = self.chunk_nodes
        return (
            f"{base}, sgl_pic chunk nodes: {len(t)} holding {t.allocated_tokens} slots "
            f"({t.protected_tokens} locked)"
        )


def build(
    ctx: Any,
    make_table: Callable[[Any], ChunkNodeTable],
    on_chunk_change: Callable[[int], None] | None = None,
    on_request_done: Callable[[str], None] | None = None,
) -> ChunkRadixCache:
    """SGLang's unified radix cache built as ``ChunkRadixCache``, its chunk table attached
    (``on_chunk_change``, ``on_request_done``: ``ChunkRadixCache``)."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    cache = create_unified_radix_cache(ctx, cache_class=ChunkRadixCache)
    if not isinstance(cache, ChunkRadixCache):
        raise RuntimeError(f"SGLang built {type(cache).__name__}, not the sgl_pic cache class")
    cache.attach(make_table(cache.token_to_kv_pool_allocator), on_chunk_change, on_request_done)
    return cache
