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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.runs import Run
from sgl_pic.engine import planner
from sgl_pic.engine.eligibility import ExtendView, Ineligible, refusal
from sgl_pic.engine.phase_port import Stack
from sgl_pic.engine.pieces import CarriedPlan, PiecePlans
from sgl_pic.engine.planner import RequestPlan
from sgl_pic.store.admission import BatchAdmission

logger = logging.getLogger(__name__)

# One chunked request's plan per batch index of the live batch.
Plans = dict[int, RequestPlan]


class ChunkSpec(NamedTuple):
    """One chunked request of the live batch, as the executor takes it on.

    row_offset: first row of its extend tokens in the live batch.
    pool_idx:   its row of SGLang's ``req_to_token``.
    prefix:     its device prefix length (tokens SGLang's prefix tree already holds).
    pending:    its verified marks (``gate.Pending``).
    config:     its effective config (the server's with its overrides).
    piece_end:  where this batch's extend of it ends: its prompt's length, or less for the
                first of several prefill pieces (planned whole, ``pieces``)."""

    row_offset: int
    pool_idx: int
    prefix: int
    pending: Pending
    config: PicConfig
    piece_end: int

    @property
    def first_piece(self) -> bool:
        return self.piece_end < len(self.pending.token_ids)

    def plan(self) -> RequestPlan:
        """A fresh plan for one attempt."""
        return RequestPlan(
            self.row_offset, self.pool_idx, self.prefix, self.pending, self.config, self.piece_end
        )


class PieceSpec(NamedTuple):
    """A later prefill piece [start, end) of a request planned at its first piece: its
    rows from ``row_offset`` in the live batch, its own row ``live_row`` of SGLang's
    request table, and the plan carried for it (``pieces.CarriedPlan``)."""

    rid: str
    row_offset: int
    live_row: int
    start: int
    end: int
    carried: CarriedPlan


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
    runs:       each plan's phase-2 runs (``Select`` writes, ``Pieces`` clips a first
                piece's to it, ``Phase2`` reads); a later piece's runs, by batch index.
    full_runs:  a first piece's runs over its whole prompt, carried to its next pieces.
    rows:       the request-table row phase 2 runs each chunked request's runs over (a
                planned-whole request's scratch row, ``pieces``).
    hidden:     the batch's hidden states # [n, hidden] (``Phase2`` writes).
    feed_timed_out: whether a layer feed of this rank's phase 2 timed out (``Phase2``).
    feed_failed: whether a layer feed of this rank's phase 2 failed otherwise (``Phase2``)."""

    stack: Stack
    input_ids: torch.Tensor  # [n]
    live: Any
    admission: BatchAdmission
    copies: list[HitCopy] = field(default_factory=list)
    query_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    probe_seconds: float = 0.0
    runs: dict[int, list[Run]] = field(default_factory=dict)
    full_runs: dict[int, list[Run]] = field(default_factory=dict)
    rows: dict[int, int] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    feed_timed_out: bool = False
    feed_failed: bool = False


class Step(Protocol):
    """One step of a chunked batch (see the module docstring)."""

    def run(self, plans: Plans, ctx: BatchContext) -> None: ...


class BatchSpecs(NamedTuple):
    """The live batch's requests the chunk path takes, by batch index: requests planned in
    this batch (``specs``) and later pieces of requests planned earlier (``pieces``)."""

    specs: dict[int, ChunkSpec]
    pieces: dict[int, PieceSpec]


def live_view(live: Any, b: int, ids: Sequence[int], start: int, end: int) -> ExtendView:
    """Request ``b`` of the live batch as ``eligibility`` reads it: its extend [start,
    end) over the ids the scheduler verified when it handed it off; the first input row
    whose logprob it asks for (-1: asked, rows unknown)."""
    logprob_start = None
    if getattr(live, "return_logprob", False):
        starts = getattr(live, "extend_logprob_start_lens_cpu", None)
        logprob_start = -1 if starts is None else int(starts[b])
    return ExtendView(ids, end, end - start, logprob_start)


def chunk_specs(
    live: Any,
    handoff: Mapping[str, Pending],
    config: PicConfig,
    metrics: PicMetrics,
    carried: PiecePlans,
) -> BatchSpecs:
    """The live batch's requests the chunk path takes: those of the hand-off whose extend
    covers their verified tokens, or a prefill piece of them. A piece that starts where
    the request's carried plan left off runs that plan's share; any other extend that
    ends inside the prompt is a first piece, planned whole (a carried plan it does not
    follow is dropped first). A request resuming after a retraction (more tokens: its
    prompt and output so far) runs as SGLang would, counted as resumed; one asking for
    logprobs of input tokens (rows this path leaves zero) runs as SGLang would, counted as
    a fallback."""
    rids = live.rids
    if not handoff or rids is None:
        return BatchSpecs({}, {})
    pool_idx = planner.pool_rows(live)
    prefix_lens = list(live.extend_prefix_lens_cpu)
    ext_lens = list(live.extend_seq_lens_cpu)
    specs: dict[int, ChunkSpec] = {}
    pieces: dict[int, PieceSpec] = {}
    row = 0
    for b, idx in enumerate(pool_idx):
        rid = rids[b]
        pending = handoff.get(rid)
        start, end = prefix_lens[b], prefix_lens[b] + ext_lens[b]
        if pending is not None:
            plan = carried.get(rid)
            if plan is not None and (start != plan.next_start or end > plan.num_tokens):
                carried.drop(rid)
                plan = None
            why = refusal(pending.token_ids, live_view(live, b, pending.token_ids, start, end))
            if why is Ineligible.RESUMED:
                # SGLang retracted it under KV pressure (``retract_decode``) and now
                # prefills its prompt and the output so far again: its prompt's KV comes
                # from its own namespace of the prefix tree where still held, the rest
                # is computed as SGLang would. Not a fallback: the prompt was served.
                logger.info("sgl_pic: request %s resumes after a retraction", rid)
                metrics.resumed.inc()
            elif why is Ineligible.INPUT_LOGPROBS:
                logger.warning("sgl_pic: request %s runs without reuse", rid)
                metrics.fallbacks.inc()
                carried.drop(rid)
            elif plan is not None:
                pieces[b] = PieceSpec(rid, row, idx, start, end, plan)
            else:
                specs[b] = ChunkSpec(row, idx, start, pending, pending.request.config(config), end)
        row += ext_lens[b]
    return BatchSpecs(specs, pieces)
