"""Promotion of host/disk chunks into chunk nodes after a request used them.

The full read and rotation of a promoted chunk run on one worker thread, off the
request's path; the nodes are filled on the scheduler's thread (``finish_ready`` at the
start of the next batch, or ``finish`` when a request needs the chunk before that), since
only that thread may touch SGLang's allocator. A promotion is of one chunk in one
isolation namespace and encoding context (``keys.segment_keys``), and fills that
namespace's nodes of that context only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from sgl_pic.core.metrics import PicMetrics
from sgl_pic.engine.batch import BatchContext, Plans
from sgl_pic.worker_threads import thread_pool

logger = logging.getLogger(__name__)

# Lower-tier chunks being promoted at once; more are dropped (counted): a promotion only
# saves a later load, and an unbounded backlog would hold host memory.
MAX_PROMOTIONS = 32

ChunkIds = tuple[int, ...]
# (isolation namespace, encoding context, chunk token ids): what one promotion fills.
JobKey = tuple[str, str, ChunkIds]


class _Job(NamedTuple):
    """One promotion under way: its full load, the chunk's ranking, the node table's
    generation at submit (a flush since drops it) and the context's contents."""

    load: Future[torch.Tensor | None]
    ranking: Any
    generation: int
    contents: tuple[str, ...]


class Promoter:
    """nodes: the chunk node table (``match``, ``generation``, ``capacity_tokens``).
    load_full(hit, chunk_ids): the chunk's whole KV # [L, 2, n, H, D], keys at 0..n-1, or
    None when its records are gone (run on the worker).
    store(chunk_ids, kv, ranking, namespace, context, context_contents): fills chunk nodes
    of ``namespace`` encoded after ``context`` (run on the scheduler's thread)."""

    def __init__(
        self,
        nodes: Any,
        load_full: Callable[[Any, ChunkIds], torch.Tensor | None],
        store: Callable[
            [ChunkIds, torch.Tensor, torch.Tensor | None, str, str, tuple[str, ...]], None
        ],
        metrics: PicMetrics,
    ) -> None:
        self.nodes = nodes
        self.load_full = load_full
        self.store = store
        self.metrics = metrics
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[JobKey, _Job] = {}

    def __contains__(self, key: JobKey) -> bool:
        return key in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(
        self,
        hit: Any,
        chunk_ids: ChunkIds,
        ranking: torch.Tensor | None,  # [n]
        namespace: str = "",
        context: str = "",
        context_contents: tuple[str, ...] = (),
    ) -> None:
        """Starts loading one chunk of ``namespace`` (encoded after ``context``, whose
        first chunk's contents are ``context_contents``) for promotion, unless it is under
        way, already a node, or the queue is full (counted as a drop)."""
        key = (namespace, context, chunk_ids)
        if self.nodes.capacity_tokens == 0 or key in self._jobs:
            return
        if self.nodes.match(chunk_ids, namespace, context) is not None:
            return
        if len(self._jobs) >= MAX_PROMOTIONS:
            self.metrics.queue_drops.labels(queue="promotion").inc()
            return
        if self._pool is None:
            self._pool = thread_pool(1, "sgl-pic-promote")
        job = self._pool.submit(self.load_full, hit, chunk_ids)
        self._jobs[key] = _Job(job, ranking, self.nodes.generation, context_contents)

    def finish_ready(self) -> None:
        """Fills chunk nodes with every promotion whose load has completed."""
        for key, job in list(self._jobs.items()):
            if job.load.done():
                self.finish(key)

    def finish(self, key: JobKey, timeout_s: float | None = None) -> bool:
        """Waits up to ``timeout_s`` for one promotion's load and fills its chunk nodes
        (unless a flush came in between, or the load found the records gone). False when
        the load is still running: it stays queued, and the caller reads the lower tier."""
        job, ranking, generation, contents = self._jobs[key]
        namespace, context, chunk_ids = key
        if generation != self.nodes.generation:
            # Begun before a flush, which dropped the chunk nodes: never waited for.
            del self._jobs[key]
            job.cancel()
            return True
        try:
            kv = job.result(timeout=timeout_s)
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - a failed promotion only loses the speed-up
            del self._jobs[key]
            logger.exception("sgl_pic: promotion of a stored chunk failed")
            return True
        del self._jobs[key]
        if kv is not None and self.nodes.match(chunk_ids, namespace, context) is None:
            self.store(chunk_ids, kv, ranking, namespace, context, contents)
            self.metrics.promotions.inc()
        return True

    def close(self) -> None:
        """Drops queued promotions and joins the worker (shutdown): at most the one chunk
        read already running is waited for."""
        for job in self._jobs.values():
            job.load.cancel()
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class Promote:
    """Step 7 of a chunked batch. Reads: each plan's lower-tier hits (those loaded sparsely
    in phase 2 and those loaded whole for a signal). Writes: the promoter's jobs (each
    chunk becomes a chunk node of its namespace once its full load is done)."""

    def __init__(self, promoter: Promoter) -> None:
        self.promoter = promoter

    def run(self, plans: Plans, ctx: BatchContext) -> None:
        for plan in plans.values():
            pending = plan.pending
            for start, end, hit in plan.lower + plan.loaded_whole:
                # Found under the context this chunk follows (``Lookup``): its contents.
                contents = pending.context_for(start).contents
                self.promoter.submit(
                    hit,
                    pending.token_ids[start:end],
                    hit.ranking,
                    hit.namespace,
                    hit.context,
                    contents,
                )
