"""Whether the chunk path takes a request's extend: one rule, read by the scheduler side
before the batch (the planned-cost charge, the hand-off) and by the worker side in it.

Each side describes the extend in an ``ExtendView``: the scheduler from SGLang's ``Req``,
the worker from the live ``ForwardBatch``. ``refusal`` names why the path does not take
it, or None; what each caller does about a refusal (counted, logged, charged as SGLang
charges) stays with the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple


class Ineligible(Enum):
    """Why an extend of a request with verified marks runs as SGLang runs it."""

    EXTRA_INPUTS = "extra_inputs"  # input embeddings or pipeline tensors in the batch
    TOKENS_CHANGED = "tokens_changed"  # other tokens than those admitted with the marks
    RESUMED = "resumed"  # prompt and output so far again, after a retraction
    INPUT_LOGPROBS = "input_logprobs"  # logits of input rows the path does not compute


class ExtendView(NamedTuple):
    """One request's extend as the rule reads it. ``token_ids``: the request's prompt as
    SGLang holds it; ``end``: where the extend ends (its prefix plus its length);
    ``extend``: its length; ``logprob_start``: the first row of the extend whose input
    logprob is asked for (None: none asked); ``extra_inputs``: the forward carries input
    embeddings or pipeline tensors."""

    token_ids: Sequence[int]
    end: int
    extend: int
    logprob_start: int | None = None
    extra_inputs: bool = False


def refusal(admitted: Sequence[int], view: ExtendView) -> Ineligible | None:
    """Why the chunk path does not take ``view`` for a request admitted with the token
    ids ``admitted``, or None when it does (the whole prompt, or a piece of it)."""
    if view.extra_inputs:
        return Ineligible.EXTRA_INPUTS
    if tuple(view.token_ids) != tuple(admitted):
        return Ineligible.TOKENS_CHANGED
    if view.end > len(admitted):
        return Ineligible.RESUMED
    if view.logprob_start is not None and view.logprob_start < view.extend - 1:
        return Ineligible.INPUT_LOGPROBS
    return None
