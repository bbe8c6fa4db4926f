"""Chunked requests take their planned cost, not their extend length, from SGLang's
prefill compute budget.

SGLang 0.5.23 forms a prefill batch with a ``PrefillAdder`` (``schedule_policy``), which
charges every admitted extend token against two compute budgets, ``rem_chunk_tokens``
(``--chunked-prefill-size``) and ``rem_input_tokens`` (``--max-prefill-tokens``), and cuts a
request longer than ``rem_chunk_tokens`` into pieces. It has no hook or policy for what a
request costs: the charge is ``_update_prefill_budget(extend_len)`` inside ``add_one_req``.
What it does give is the class: ``Scheduler.get_prefill_adder_class()`` is the scheduler's
factory of its adder, and a HookRegistry AROUND hook on it (``hooks.PrefillAdderFactory``)
hands SGLang ``PlannedCostAdder`` instead, a subclass that changes two steps of
``add_one_req`` for a request the chunk path will take whole (``PlannedCharges.cost``):

- selection (``_select_prefill_admission``, pure: it allocates nothing): asked with both
  compute budgets raised by (extend - planned cost), so the request is taken whole exactly
  when its planned cost fits the budget left; when it does not fit whole (the budget, or
  memory through the chunk limit SGLang's memory budget applies), the selection is made
  again as SGLang makes it, and each piece is charged its length. That over-charges the
  pieces after the first and under-charges the first, which runs the whole request's
  lookups, phase 1 and signals (``engine.pieces``): a known limit of this estimate.
- commit (``_commit_prefill_admission``): SGLang commits under the same raised budgets
  (its SWA memory budget sizes the window allocation by the chunk limit) and charges the
  extend; the difference to the planned cost is given back to both compute budgets.

Memory is SGLang's, untouched: ``memory_budget`` reserves KV slots for every extend token
(``rem_total_tokens`` still counts all of them), and so do the load-back and scratch checks.
Rows are bounded besides: a batch's extend rows never exceed ``row_limit``, SGLang's own
bound on a prefill batch (``--max-prefill-tokens``, what the adder starts ``rem_input_tokens``
at): what is given back is capped so that rows admitted plus ``rem_chunk_tokens`` stay under
it, since a batch whose chunk path fails runs every row as plain prefill.

Scheduler side: the adder lives for one pass of ``Scheduler._get_new_batch_prefill_raw``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from sglang.srt.managers.schedule_batch import compute_extend_logprob_start_len
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import AdmittedMarks
from sgl_pic.engine.eligibility import ExtendView, refusal
from sgl_pic.engine.planned_cost import PlannedCost, TierPresence

logger = logging.getLogger(__name__)


class PlannedCharges:
    """The planned cost of queued requests, for every scheduling pass of one runtime.

    marks:         the runtime's admitted marks (``gate.AdmittedMarks``), by request id.
    server_config: the server's ``PicConfig`` (each request's overrides apply on it).
    estimator:     ``PlannedCost`` over the chunk nodes and lower tiers (it keeps what a
                   waiting request's next estimate can reuse)."""

    def __init__(
        self, marks: AdmittedMarks, server_config: PicConfig, estimator: PlannedCost
    ) -> None:
        self.marks = marks
        self.server_config = server_config
        self.estimator = estimator

    def cost(self, req: Any, prefix_len: int) -> int | None:
        """What SGLang's ``Req`` ``req`` costs when extended whole from ``prefix_len``, in
        rows of a forward, or None where the chunk path will not take it whole (no verified
        marks, other tokens than admitted, a resume after a retraction, input-token
        logprobs, input embeddings, or no estimate: SGLang's charge stands). Never raises."""
        pending = self.marks.get(req.rid)
        if pending is None:
            return None
        fill = len(req.full_untruncated_fill_ids)
        extend = fill - prefix_len
        start = None
        if req.return_logprob and extend > 0:
            start = compute_extend_logprob_start_len(
                logprob_start_len=req.logprob_start_len,
                prefix_len=prefix_len,
                extend_len=extend,
                full_untruncated_fill_len=fill,
            )
        view = ExtendView(
            req.origin_input_ids,
            fill,
            extend,
            start,
            getattr(req, "input_embeds", None) is not None,
        )
        # Charged at the plan only when extended whole (``eligibility``, as the batch
        # hand-off and ``batch.chunk_specs`` decide it).
        if extend <= 0 or fill != len(pending.token_ids) or refusal(pending.token_ids, view):
            return None
        try:
            config = pending.request.config(self.server_config)
            return self.estimator.estimate(pending, config, prefix_len).cost
        except Exception:
            logger.exception(
                "sgl_pic: no planned cost for request %s; charged as SGLang does", req.rid
            )
            return None


def planned_charges(runtime: Any) -> PlannedCharges | None:
    """``PlannedCharges`` over ``runtime``'s (a ``PicRuntime``) marks, chunk nodes and
    tiers; None where reuse is off in this process."""
    executor = getattr(runtime, "executor", None)
    if executor is None:
        return None
    estimator = PlannedCost(
        TierPresence(executor.nodes, executor.lower),
        executor.kv.num_layers,
        executor.select.ratios,
    )
    return PlannedCharges(runtime.marks, executor.config, estimator)


class PlannedCostAdder(PrefillAdder):
    """SGLang's ``PrefillAdder`` charging chunked requests their planned cost (see the
    module docstring); SGLang's own arguments, and ``planned``, the runtime's charges
    (None: the adder is SGLang's). Costs are kept for the pass by (request id, device
    prefix): selection and commit ask for the same one, and a pass changes no chunk tier."""

    def __init__(self, *args: Any, planned: PlannedCharges | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.planned = planned
        self._costs: dict[tuple[str, int], int | None] = {}
        # SGLang's bound on one prefill batch's rows (rem_input_tokens before any charge).
        self.row_limit = max(self.rem_input_tokens, self.rem_chunk_tokens or 0)

    def _cost(self, req: Any, prefix_len: int) -> int | None:
        if self.planned is None or self.dllm_config is not None:
            return None
        key = (req.rid, prefix_len)
        if key not in self._costs:
            self._costs[key] = self.planned.cost(req, prefix_len)
        return self._costs[key]

    # ----------------------------------------------------------------- budgets
    def _compute_left(self) -> int:
        """The compute budget that limits the next request: the chunk budget, or the input
        budget where chunked prefill is off."""
        return self.rem_input_tokens if self.rem_chunk_tokens is None else self.rem_chunk_tokens

    def _rows(self) -> int:
        return sum(int(r.extend_len) for r in self.can_run_list)

    def _charged(self, extend_len: int) -> int:
        """What ``_update_prefill_budget`` takes from the compute budgets for an extend."""
        return extend_len if self.exact_chunk_fill else self.ceil_paged_tokens(extend_len)

    def _give_back(self, tokens: int) -> None:
        self.rem_input_tokens += tokens
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens += tokens

    def _discount(self, req: Any, prefix_len: int) -> int:
        """How much less than SGLang's charge the whole extend of ``req`` from
        ``prefix_len`` costs, within the rows left; 0 for a request charged as SGLang does."""
        cost = self._cost(req, prefix_len)
        if cost is None:
            return 0
        extend = len(req.full_untruncated_fill_ids) - prefix_len
        room = self.row_limit - self._rows() - self._compute_left()
        return max(0, min(self._charged(extend) - cost, room))

    # ----------------------------------------------------------------- SGLang's steps
    def _select_prefill_admission(self, req: Any, **kwargs: Any) -> Any:
        """SGLang's selection, asked with the compute budgets raised by the request's
        discount; kept only when it takes the request whole (else asked again as is)."""
        discount = self._discount(req, req.prefix_len + kwargs.get("host_hit_length", 0))
        if discount > 0:
            self._give_back(discount)
            try:
                admission = super()._select_prefill_admission(req, **kwargs)
            finally:
                self._give_back(-discount)
            if not isinstance(admission, AddReqResult) and not admission.is_chunked:
                return admission
        return super()._select_prefill_admission(req, **kwargs)

    def _commit_prefill_admission(self, req: Any, admission: Any, mamba_gap_reserve: int) -> None:
        """SGLang's commit, under the budgets selection saw (SGLang's SWA memory budget
        sizes a request's window allocation by the chunk limit, which must cover the whole
        extend); a whole chunked request then keeps charged only its planned cost (less
        where the rows left would not cover what it gives back)."""
        discount = 0 if admission.is_chunked else self._discount(req, admission.prefix_len)
        self._give_back(discount)
        try:
            super()._commit_prefill_admission(req, admission, mamba_gap_reserve)
        finally:
            self._give_back(-discount)
        if discount <= 0:
            return
        cost = self._cost(req, admission.prefix_len)
        if cost is None:
            return
        room = self.row_limit - self._rows() - self._compute_left()
        back = min(self._charged(admission.extend_len) - cost, room)
        if back > 0:
            self._give_back(back)


def adder_factory(base: Any, planned: PlannedCharges) -> Any:
    """What the scheduler's ``get_prefill_adder_class()`` hands back: a constructor of
    ``PlannedCostAdder`` over ``planned`` in place of SGLang's own ``PrefillAdder`` (SGLang
    only calls it, with the adder's arguments); any other class (another plugin's) is
    left as it is, logged."""
    if base is PrefillAdder:
        return functools.partial(PlannedCostAdder, planned=planned)
    logger.warning(
        "sgl_pic: the scheduler builds %s, not SGLang's PrefillAdder; chunked requests "
        "are charged their whole extend",
        getattr(base, "__qualname__", base),
    )
    return base
