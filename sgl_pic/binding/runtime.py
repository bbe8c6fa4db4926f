"""``PicRuntime``: everything sgl-pic keeps per scheduler process, and the methods SGLang's
callbacks reach it through.

One runtime is built per scheduler process, when SGLang builds the ``sgl_pic`` radix cache
(``plugin.build_tree_cache``), and it owns that process's state: the admission gate, the
verified marks of admitted requests (``gate.AdmittedMarks``, by request id), the hand-off
of the batch being forwarded, the phase runner and the chunk executor. Nothing of it is
kept on SGLang's objects.

Its methods are split by the side that calls them, as a KV connector's are in vLLM v1
(SGLang runs both sides in the scheduler process, on its one thread):

Scheduler side: runs in the scheduler's event loop, between forwards.
    admit()          - checks a request before SGLang queues it; honoured marks go into
                       ``marks`` under its request id.
    prepare_batch()  - makes an extend batch's hand-off: its requests with marks.
    request_done()   - SGLang finished or aborted a request (``ChunkRadixCache``): its
                       marks and any plan carried for its next prefill pieces go.
    weights_changed() - SGLang changed the served weights: every tier is re-keyed.
Worker side: runs in the model runner's forward.
    on_extend()      - takes the hand-off and runs the batch's chunk execution, or None.
    on_bypass()      - drops the hand-off of a batch the executor cannot take (counted).
    runs_phase() / torch_native_extend() - torch_native attention for a phase batch.
    keeps_off_prefill_graph() - whether a batch must skip SGLang's prefill CUDA graph.

SGLang's hooks (``binding.hooks``) are registered when the plugin loads, before any
runtime exists, and SGLang calls them with its own arguments only; so they find the
runtime through the one process-level reference below (``current``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sgl_pic.binding.phases import PhaseRunner
from sgl_pic.core.drift_signal import DriftSignal
from sgl_pic.core.gate import AdmissionGate, AdmittedMarks, Pending
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.engine.eligibility import ExtendView, refusal
from sgl_pic.engine.executor import ChunkExecutor
from sgl_pic.engine.rank_agreement import PeerFailed, RankAgreement

logger = logging.getLogger(__name__)

Stack = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class PicRuntime:
    """gate:    the scheduler-side admission gate; its ``marks`` are the runtime's.
    metrics:   the process's ``PicMetrics``.
    executor:  the chunk executor (``engine.executor.ChunkExecutor``), None where reuse is
               off in this process (the gate then honours no marks).
    phases:    the phase runner the executor runs its forwards through (None with it).
    drift:     reports the first-token entropy of the requests the executor served
               (``drift_signal``); None: not reported."""

    def __init__(
        self,
        gate: AdmissionGate,
        metrics: PicMetrics,
        executor: ChunkExecutor | None = None,
        phases: PhaseRunner | None = None,
        drift: DriftSignal | None = None,
    ) -> None:
        self.gate = gate
        self.drift = drift
        self.marks: AdmittedMarks = gate.marks
        self.metrics = metrics
        self.executor = executor
        self.phases = phases
        # The chunked requests of the batch SGLang prepared last, by request id: set by
        # ``prepare_batch``, taken by the forward that follows (``on_extend``).
        self._handoff: dict[str, Pending] = {}

    # ----------------------------------------------------------------- scheduler side
    def admit(self, req: Any) -> str | None:
        """Scheduler side, once per generate request SGLang accepted, before it is
        queued: an error to refuse it with, or None (``AdmissionGate.admit``; never
        raises). Honoured marks go into ``marks`` under the request's id."""
        return self.gate.admit(req)

    def prepare_batch(self, batch: Any) -> None:
        """Scheduler side, after SGLang prepared an extend batch (its
        ``ScheduleBatch.prepare_for_extend``): the batch's requests with admitted marks
        become the hand-off of the forward that follows. It replaces the previous one:
        SGLang forwards a batch right after preparing it, on this thread, so nothing of an
        earlier batch may linger into this one. A request whose token ids changed since
        admission runs without reuse, counted."""
        if self.executor is None:
            return
        handoff: dict[str, Pending] = {}
        for req in batch.reqs:
            pending = self.marks.get(req.rid)
            if pending is None:
                continue
            ids = req.origin_input_ids
            if refusal(pending.token_ids, ExtendView(ids, len(ids), len(ids))) is not None:
                logger.warning(
                    "sgl_pic: request %s changed tokens after admission; it runs without reuse",
                    req.rid,
                )
                self.metrics.marks_ignored.labels(reason="tokens_changed").inc()
                continue
            handoff[req.rid] = pending
        self._handoff = handoff

    def request_done(self, rid: str) -> None:
        """Scheduler side, when SGLang ends request ``rid`` (finished or aborted): its
        marks are dropped, and a plan carried for its next prefill pieces with them."""
        self.marks.drop(rid)
        if self.executor is not None:
            self.executor.request_done(rid)

    def weights_changed(self, source: str, model_id: str) -> None:
        """Scheduler side, after SGLang applied a weight update from ``source`` (its
        manager's method returned; ``weight_updates``): every tier is keyed under
        ``model_id`` from now on, so no request after it finds KV of the old weights."""
        self.metrics.weight_updates.labels(source=source).inc()
        if self.executor is not None:
            self.executor.rekey(model_id)
            logger.info("sgl_pic: weights updated (%s); chunks keyed by %s", source, model_id[:12])

    @property
    def handoff(self) -> dict[str, Pending]:
        """The hand-off of the batch prepared last (read only; ``prepare_batch`` sets it,
        the forward takes it)."""
        return dict(self._handoff)

    # ----------------------------------------------------------------- worker side
    def on_extend(
        self,
        stack: Stack,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        forward_batch: Any,
    ) -> torch.Tensor | None:
        """Worker side: the decoder stack's extend batches (``model_hooks.install``).
        Takes the hand-off and runs chunk execution when the batch carries chunked
        requests; None lets the stack run it as SGLang would. A phase forward re-entering
        the stack is never taken (phases do not nest)."""
        executor, phases = self.executor, self.phases
        if executor is None or phases is None or phases.context is not None:
            return None
        if self.drift is not None:
            self.drift.mark(())  # no mark of an earlier forward reaches this one's logits
        if forward_batch.extend_prefix_lens_cpu is None:
            return None
        handoff, self._handoff = self._handoff, {}
        try:
            hidden = executor.forward(stack, input_ids, forward_batch, handoff)
            if hidden is not None and self.drift is not None:
                self.drift.mark(executor.served_rows)
            return hidden
        except Exception as e:
            # SGLang kills the whole server when a scheduler raises. Running the batch as
            # SGLang would rewrites every new token's KV from scratch, so whatever the failed
            # attempt wrote is overwritten; the request is served without reuse and the
            # failure counted. The phase context was taken down by ``PhaseRunner.running``.
            # With tensor parallelism every rank must take that path: a rank's own failure
            # is put to the others first (``RankAgreement.fail``); ``PeerFailed`` is theirs.
            if isinstance(e, PeerFailed):
                logger.warning("sgl_pic: another rank's chunk execution failed; %s", _PLAIN)
            else:
                logger.exception("sgl_pic: chunk execution failed; %s", _PLAIN)
                _tell_peers(executor.ranks)
            self.metrics.failures.inc()
            try:
                # The backend was planned for a phase batch: plan it for the live one again.
                phases.backend.init_forward_metadata(forward_batch)
            except Exception:
                logger.exception("sgl_pic: re-planning the attention backend failed")
            return None
        # On success the backend's metadata describes the last phase batch; nothing after
        # the decoder stack (the logits processor, sampling) reads it, and the next batch
        # is planned afresh by SGLang.

    def on_logits(self, metadata: Any, output: Any) -> None:
        """Worker side: after SGLang's logits processor ran (``model_hooks.install``); the
        requests the last extend served get their first-token entropy (``drift_signal``)."""
        if self.drift is not None:
            self.drift.on_logits(metadata, output)

    def on_bypass(self, forward_batch: Any) -> None:
        """Worker side: an extend batch the executor cannot take (input embeddings,
        pipeline tensors); its chunked requests run exact, counted."""
        if self._handoff:
            logger.warning(
                "sgl_pic: %d chunked request(s) in a batch with input embeddings run without reuse",
                len(self._handoff),
            )
            self.metrics.fallbacks.inc(len(self._handoff))
            self._handoff = {}

    def runs_phase(self, forward_batch: Any) -> bool:
        """Worker side: whether ``forward_batch`` is the phase batch being forwarded."""
        return self.phases is not None and forward_batch is self.phases.batch

    def torch_native_extend(
        self,
        backend: Any,
        q: torch.Tensor,  # [n, num_heads * head_dim]
        k: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
        v: torch.Tensor | None,  # [n, num_kv_heads, head_dim]
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Worker side: torch_native's extend for the phase batch under way
        (``attention.torch_native_phase_extend``, over its row groups)."""
        from sgl_pic.binding.attention import torch_native_phase_extend

        assert self.phases is not None
        groups = self.phases.row_groups()
        return torch_native_phase_extend(
            backend, q, k, v, layer, forward_batch, groups, save_kv_cache
        )

    def keeps_off_prefill_graph(self, forward_batch: Any) -> bool:
        """Worker side, before SGLang replays a prefill CUDA graph: whether the batch must
        run eagerly because it carries chunked requests of the hand-off (a replayed graph
        would bypass the decoder-stack wrapper and prefill them exactly). A batch without
        request ids may carry some: eager."""
        if not self._handoff:
            return False
        rids = getattr(forward_batch, "rids", None)
        return rids is None or any(rid in self._handoff for rid in rids)

    def close(self) -> None:
        """Joins the executor's background work (shutdown)."""
        if self.executor is not None:
            self.executor.close()


# The one process-level reference (see the module docstring for why it must exist): set
# once by ``plugin.build_tree_cache`` in the scheduler process, read by ``binding.hooks``.
_current: PicRuntime | None = None


_PLAIN = "running the batch without reuse"


def _tell_peers(ranks: RankAgreement) -> None:
    try:
        ranks.fail()
    except Exception:  # the collective itself broke: nothing more to agree on
        logger.exception("sgl_pic: telling the other ranks of a failure failed")


def current() -> PicRuntime | None:
    """This process's runtime, None before the ``sgl_pic`` backend is built (and in
    processes that never build it): every hook then passes straight through to SGLang."""
    return _current


def set_current(runtime: PicRuntime | None) -> PicRuntime | None:
    """Makes ``runtime`` this process's runtime; returns the one it replaces (tests put it
    back)."""
    global _current
    previous, _current = _current, runtime
    return previous
