"""What the engine asks of SGLang to run a phase forward: the ``PhaseRunner`` protocol,
implemented by ``binding.phases.PhaseRunner`` (the engine never imports the binding)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from sgl_pic.core.runs import SubRequest

# Called with a decoder layer's index, before or after it runs in a phase forward.
LayerFn = Callable[[int], None]
# (layer, RadixAttention, its post-RoPE queries # [n, heads * head_dim])
AttentionFn = Callable[[int, Any, "torch.Tensor | None"], None]
# The decoder stack's own forward: (input ids, positions, ForwardBatch) -> hidden states.
Stack = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class PhaseBatch(Protocol):
    """A planned phase batch (``PhaseRunner.prepare``): its sub-requests, and SGLang's
    batch the engine hands back to ``PhaseRunner.run`` unread."""

    @property
    def subrequests(self) -> tuple[SubRequest, ...]: ...


@runtime_checkable
class PhaseRunner(Protocol):
    """Phase batches through SGLang's attention backend and decoder stack, and the rows
    of its request table they run over. Worker side: the scheduler's forward thread."""

    @property
    def req_to_token(self) -> torch.Tensor:  # [max_reqs, max_len] SGLang's request table
        ...

    @property
    def max_subrequests(self) -> int | None:
        """Sub-requests one phase batch may hold (None: no limit)."""
        ...

    def prepare(
        self, live: Any, subrequests: Sequence[SubRequest], input_ids: torch.Tensor
    ) -> PhaseBatch:
        """Plans ``subrequests`` (# [sum extend] ``input_ids``) beside the live batch
        ``live``: after this the backend's metadata describes the phase batch."""
        ...

    def run(
        self,
        stack: Stack,
        phase: Any,  # a PhaseBatch this runner prepared
        before_layer: Sequence[LayerFn] = (),
        after_layer: Sequence[LayerFn] = (),
        after_attention: Sequence[AttentionFn] = (),
    ) -> torch.Tensor:
        """# [sum extend, hidden] the stack's output over ``phase``, with the callbacks
        called around each layer and attention during it."""
        ...

    def scratch_rows(self, n: int) -> list[int] | None:
        """``n`` free rows of the request table (None when fewer are free)."""
        ...

    def free_rows(self, rows: list[int]) -> None:
        """Gives rows from ``scratch_rows`` back once nothing queued reads them."""
        ...
