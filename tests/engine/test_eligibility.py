"""The one rule for whether the chunk path takes an extend (``engine.eligibility``), and
its readers agreeing on it: the planned-cost charge, the hand-off, the live batch."""

from __future__ import annotations

from types import SimpleNamespace

from sgl_pic.engine.batch import live_view
from sgl_pic.engine.eligibility import ExtendView, Ineligible, refusal

IDS = (5, 6, 7, 8)


def test_each_refusal_and_the_order_they_are_read_in() -> None:
    assert refusal(IDS, ExtendView(IDS, 4, 4)) is None
    assert refusal(IDS, ExtendView(IDS, 2, 2)) is None  # a first prefill piece
    assert refusal(IDS, ExtendView((5, 6, 7, 9), 4, 4)) is Ineligible.TOKENS_CHANGED
    assert refusal(IDS, ExtendView(IDS, 6, 6)) is Ineligible.RESUMED
    assert refusal(IDS, ExtendView(IDS, 4, 4, logprob_start=3)) is None  # the last row only
    assert refusal(IDS, ExtendView(IDS, 4, 4, logprob_start=2)) is Ineligible.INPUT_LOGPROBS
    extras = ExtendView((1,), 9, 9, logprob_start=0, extra_inputs=True)
    assert refusal(IDS, extras) is Ineligible.EXTRA_INPUTS  # read first


def test_the_live_batch_view_reads_sglangs_logprob_starts() -> None:
    plain = SimpleNamespace(return_logprob=False)
    assert live_view(plain, 0, IDS, 0, 4) == ExtendView(IDS, 4, 4, None)
    asked = SimpleNamespace(return_logprob=True, extend_logprob_start_lens_cpu=[3, 1])
    assert refusal(IDS, live_view(asked, 0, IDS, 0, 4)) is None
    assert refusal(IDS, live_view(asked, 1, IDS, 0, 4)) is Ineligible.INPUT_LOGPROBS
    # Asked, with no starts to read: every row may be asked for, even of a one-row extend.
    unknown = SimpleNamespace(return_logprob=True)
    assert refusal(IDS, live_view(unknown, 0, IDS, 3, 4)) is Ineligible.INPUT_LOGPROBS
