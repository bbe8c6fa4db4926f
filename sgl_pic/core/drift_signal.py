"""The served drift signal: the first-token entropy of each request served by reuse.

Of the per-request signals measured (``bench/RESULTS.md``, "Signals of the recompute
pass"), the confidence of the served first-token distribution ranks requests by their
first-token KL to exact prefill about as well as any, and needs no second pass, where the
probe's attention, CacheBlend's deviation and the recomputed rows' K/V change rank them
worse. A near tie has more probability mass for stale KV to move. It costs one softmax
over logits SGLang computes anyway. It is a rank, in nats, not a KL: nothing here maps it
to a KL for a given model.

After SGLang's logits processor ran an extend batch whose requests the chunk executor
served (``mark``), those requests' next-token logits give their entropies; they go into
the processor's output as ``customized_info`` (SGLang's own per-request channel into
``meta_info``) under ``META_KEY``, None for the batch's other requests, and into the
``sgl_pic_first_token_entropy`` histogram. ``meta_info`` carries floats, so a batch with
such requests waits once for its logits on the host, where SGLang's sampling reads them
next; batches without any add nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

META_KEY = "pic_first_token_entropy"


def entropy(logits: torch.Tensor) -> torch.Tensor:  # logits: [n, vocab]
    """# [n] float32 entropy (nats) of each row's softmax. A token a model masks with
    -inf logits (padded vocabulary) has probability 0 and adds 0, not 0 * -inf = NaN."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    terms = torch.where(torch.isneginf(logp), 0.0, logp.exp() * logp)
    return -terms.sum(dim=-1)


class DriftSignal:
    """observe(value): the histogram's ``observe``.

    Worker side, on the scheduler's forward thread. State: the batch rows of the last
    forward the executor served, set by ``mark`` and taken by the next ``on_logits``
    (SGLang runs the logits processor right after the decoder stack, in the same forward),
    so rows never outlive the forward that set them."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self.observe = observe
        self._rows: tuple[int, ...] = ()

    def mark(self, rows: Sequence[int]) -> None:
        """The live batch's indices of the requests the executor served in this forward
        (replaces any earlier mark)."""
        self._rows = tuple(rows)

    def on_logits(self, metadata: Any, output: Any) -> None:
        """After the logits processor (``metadata``: its ForwardBatch or LogitsMetadata,
        ``output``: its LogitsProcessorOutput, whose ``customized_info`` this sets). Takes
        the mark whatever the batch; writes only for an extend batch with logits."""
        rows, self._rows = self._rows, ()
        if not rows:
            return
        mode = getattr(metadata, "forward_mode", None)
        logits = getattr(output, "next_token_logits", None)
        if mode is None or not mode.is_extend() or logits is None or logits.dim() != 2:
            return
        n = logits.shape[0]
        rows = tuple(r for r in rows if r < n)
        info = output.customized_info if output.customized_info is not None else {}
        if META_KEY in info:
            logger.warning("sgl_pic: the model's logits output has %s already", META_KEY)
            return
        # The one host read (module doc).
        values = entropy(logits[list(rows)]).tolist()
        column: list[float | None] = [None] * n
        for r, v in zip(rows, values, strict=True):
            column[r] = v
            self.observe(v)
        info[META_KEY] = column
        output.customized_info = info
