"""CacheBlend's layer-1 signal, caught at decoder-layer boundaries of a phase forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class DeviationProbe:
    """CacheBlend's signal: after decoder layer ``layer`` (1: the first whose K/V depend
    on context) has run over the pass's tokens, their fresh K/V at ``slots`` against the
    reused K/V that were there before. The reused values are put back and the forward is
    cut there (``ProbeDone``), so later layers never run and the pool is as it was
    (layer 0's K/V are context-free: fresh equals reused)."""

    def __init__(
        self,
        pool: Any,
        slots: torch.Tensor,  # [n] pool slots of the pass's tokens
        layer: int = 1,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.pool = pool
        self.reduce = reduce  # sums over tensor-parallel ranks (each holds its own heads)
        self.slots = slots.to(pool.get_key_buffer(layer).device)  # [n] pool slots
        self.layer = layer
        self._k_old = pool.get_key_buffer(layer)[self.slots].clone()
        self._v_old = pool.get_value_buffer(layer)[self.slots].clone()
        self.deviation: torch.Tensor | None = None  # [n] once caught

    def after_layer(self, layer: int) -> None:
        if layer != self.layer:
            return
        kb, vb = self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer)
        n = self.slots.numel()
        k_new = kb[self.slots].reshape(n, -1).float()
        v_new = vb[self.slots].reshape(n, -1).float()
        k_old = self._k_old.reshape(n, -1).float()
        v_old = self._v_old.reshape(n, -1).float()
        dev = ((k_new - k_old).norm(dim=1) + (v_new - v_old).norm(dim=1)).float()
        self.deviation = dev if self.reduce is None else self.reduce(dev)
        kb[self.slots] = self._k_old
        vb[self.slots] = self._v_old
        raise ProbeDone


class ProbeDone(Exception):
    """Ends a deviation pass once its probe has caught layer ``layer``'s K/V."""
