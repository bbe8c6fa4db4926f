"""What the steps of one chunked batch share: the named spec of each chunked request, the
per-batch context the steps read and write, and the ``Step`` contract.

A batch runs as a pipeline of steps (``executor.ChunkExecutor.forward``): lookup ->
assemble -> phase 1 -> signals -> select -> phase 2 -> promote. Each step is an object
with ``run(plans, ctx)``; its docstring says what it reads and writes of the plans
(``planner.RequestPlan``, one per chunked request, by batch index) and of ``BatchContext``.
Steps run on the scheduler's forward thread, in that order, once per attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from sgl_pic.binding.gate import Pending
from sgl_pic.binding.metrics import PicMetrics
from sgl_pic.binding.phases import Run
from sgl_pic.config import PicConfig
from sgl_pic.engine import planner
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.store.admission import BatchAdmission

logger = logging.getLogger(__name__)

# The decoder stack's own forward: (ids # [n], positions # [n], ForwardBatch) -> # [n, hidden]
Stack = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
# One chunked request's plan per batch index of the live batch.
Plans = dict[int, RequestPlan]


class ChunkSpec(NamedTuple):
    """One chunked request of the live batch, as the executor takes it on.

    row_offset: first row of its extend tokens in the live batch.
    pool_idx:   its row of SGLang's ``req_to_token``.
    prefix:     its device prefix length (tokens SGLang's prefix tree already holds).
    pending:    its verified marks (``gate.Pending``).
    config:     its effective config (the server's with its overrides)."""

    row_offset: int
    pool_idx: int
    prefix: int
    pending: Pending
    config: PicConfig

    def plan(self) -> RequestPlan:
        """A fresh plan for one attempt."""
        return RequestPlan(self.row_offset, self.pool_idx, self.prefix, self.pending, self.config)


class HitCopy(NamedTuple):
    """One device hit's copy: the chunk node's slots from the first row past the device
    prefix, the request's slots they go to, and the positions its keys move by (the
    chunk's start: node keys sit at chunk positions 0..n-1)."""

    src: torch.Tensor  # [n] node slots
    dst: torch.Tensor  # [n] request slots
    delta: int


@dataclass
class BatchContext:
    """The live batch and what one attempt's steps hand each other.

    stack, input_ids, live: the decoder stack's forward, the live batch's extend tokens
                (# [n]) and the ForwardBatch SGLang built (read by every step).
    admission:  store admission's view of this batch (``lookup`` writes it).
    copies:     device hits to copy into the requests' slots (``Lookup`` writes,
                ``Assemble`` reads).
    query_scores: the query-aware signal # [prompt_len] of each plan the shared probe
                pass covered, by batch index (``Signals`` writes, ``Select`` reads).
    probe_seconds: how long that pass took (added to each covered plan's selection time).
    runs:       each plan's phase-2 runs (``Select`` writes, ``Phase2`` reads).
    hidden:     the batch's hidden states # [n, hidden] (``Phase2`` writes)."""

    stack: Stack
    input_ids: torch.Tensor  # [n]
    live: Any
    admission: BatchAdmission
    copies: list[HitCopy] = field(default_factory=list)
    query_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    probe_seconds: float = 0.0
    runs: dict[int, list[Run]] = field(default_factory=dict)
    hidden: torch.Tensor | None = None


class Step(Protocol):
    """One step of a chunked batch (see the module docstring)."""

    def run(self, plans: Plans, ctx: BatchContext) -> None: ...


def chunk_specs(
    live: Any, handoff: Mapping[str, Pending], config: PicConfig, metrics: PicMetrics
) -> dict[int, ChunkSpec]:
    """The live batch's requests the chunk path takes, by batch index: those of the
    hand-off whose extend covers exactly their verified tokens. A request resuming after a
    retraction (more tokens: its prompt and output so far) runs as SGLang would, counted
    as resumed; a chunked-prefill piece before the last, or one asking for logprobs of
    input tokens (rows this path leaves zero), runs as SGLang would, counted as a
    fallback."""
    rids = live.rids
    if not handoff or rids is None:
        return {}
    pool_idx = planner.pool_rows(live)
    prefix_lens = list(live.extend_prefix_lens_cpu)
    ext_lens = list(live.extend_seq_lens_cpu)
    specs: dict[int, ChunkSpec] = {}
    row = 0
    for b, idx in enumerate(pool_idx):
        pending = handoff.get(rids[b])
        total = prefix_lens[b] + ext_lens[b]
        if pending is not None:
            if total > len(pending.token_ids):
                # SGLang retracted it under KV pressure (``retract_decode``) and now
                # prefills its prompt and the output so far again: its prompt's KV comes
                # from its own namespace of the prefix tree where still held, the rest
                # is computed as SGLang would. Not a fallback: the prompt was served.
                logger.info("sgl_pic: request %s resumes after a retraction", rids[b])
                metrics.resumed.inc()
            elif total != len(pending.token_ids) or planner.wants_input_logprobs(live, b):
                logger.warning("sgl_pic: request %s runs without reuse", rids[b])
                metrics.fallbacks.inc()
            else:
                specs[b] = ChunkSpec(
                    row, idx, prefix_lens[b], pending, pending.request.config(config)
                )
        row += ext_lens[b]
    return specs
