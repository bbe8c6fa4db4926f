"""The query-aware signal inside the server: the question's attention to the reused KV.

A probe pass is an ordinary phase batch of the request's fresh tokens (and the tokens
phase 2 must compute anyway) over its assembled KV. After each of the first ``layers``
decoder layers' RadixAttention (by then the pass's own K/V of that layer are in the pool),
the question's post-RoPE queries score the request's whole row of keys with
``question_attention``, the definition the oracle uses too; right after the last of those
attentions the pass is cut (``ProbeCut`` raises ``ProbeDone``), so neither that layer's MLP
nor the rest of the stack runs. The probe writes only the pass's own slots at those layers,
which phase 2 writes again.

Several requests' probes share one pass (one ``QueryProbe`` each, rows offset by where the
request's tokens sit in the batch): on a CPU the dense layers cost several times more per
token in a forward of a few dozen tokens than in one of a few hundred, since each forward
reads every layer's weights (``bench/layer_batch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sgl_pic.engine.deviation_probe import ProbeDone
from sgl_pic.engine.device_copy import to_device
from sgl_pic.engine.kv_access import STAGING_BYTES
from sgl_pic.selection.query_aware import question_attention

# Float32 tensors of one tile's logits ``question_attention`` holds at once per key and
# row (the logits, their exponentials, the normalised weights).
LOGIT_COPIES = 3


class PoolKeys:
    """One layer's keys at ``slots`` (# [num_keys]), gathered from the pool a tile at a
    time as ``question_attention`` reads them (its ``KeyRows``): only a tile's keys are
    copied out at once, not the whole prompt's."""

    def __init__(
        self,
        buffer: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] the pool's layer
        slots: torch.Tensor,  # [num_keys] on its device, checked by the caller
    ) -> None:
        self.buffer = buffer
        self.slots = slots
        self.shape = torch.Size((slots.numel(), *buffer.shape[1:]))
        self.device = buffer.device

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """# [rows, num_kv_heads, head_dim]"""
        # index_select: whole rows, faster than the generic gather (``attention``).
        return self.buffer.index_select(0, self.slots[rows])


def probe_tile(rows: int, key_row_bytes: int, staging_bytes: int) -> int:
    """Keys ``question_attention`` scores at once so that a tile's float32 logits for
    ``rows`` query heads x queries and its gathered keys (``key_row_bytes`` each, plus
    their float32 copy) stay within ``staging_bytes``; one key at least."""
    per_key = LOGIT_COPIES * 4 * rows + key_row_bytes * 2
    return max(1, staging_bytes // per_key)


class QueryProbe:
    """pool:      SGLang's KV pool (MHATokenToKVPool).
    key_slots:    # [num_tokens] pool slots of the request's positions 0..num_tokens-1.
    query_rows:   # [q] rows of the question's tokens in the probe batch.
    query_pos:    # [q] their positions. Rows and positions (host tensors, planning)
                  reach the device once, in one copy that does not block, and the least
                  position, which each layer's mask starts from, is read here on the host:
                  per layer, a host copy would block and a device read would sync.
    layers:       decoder layers scored (0..layers-1).
    reduce:       sums a tensor over tensor-parallel ranks (each rank holds its own heads);
                  identity on one rank.
    staging_bytes: most a layer's scoring copies out at once (``probe_tile``): the keys
                  and logits of a tile of the prompt, however long the prompt."""

    def __init__(
        self,
        pool: Any,
        key_slots: torch.Tensor,
        query_rows: torch.Tensor,
        query_pos: torch.Tensor,
        layers: int,
        reduce: Any = None,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        device = pool.get_key_buffer(0).device
        self.pool = pool
        self.key_slots = key_slots.to(device)
        nq = query_pos.numel()
        host = torch.cat([query_rows.cpu(), query_pos.cpu()]).to(torch.int64)  # host: planning
        self.first_pos = int(query_pos.min()) if nq else None
        self.query_rows, self.query_pos = to_device(host, device).split([nq, nq])
        self.layers = layers
        self.reduce = reduce
        self.staging_bytes = staging_bytes
        self._total = torch.zeros(key_slots.numel(), device=device)
        self._seen: set[int] = set()

    def after_attention(
        self,
        layer: int,
        module: Any,  # sglang RadixAttention
        q: torch.Tensor | None,  # [num_tokens, num_heads * head_dim] post-RoPE queries
    ) -> None:
        if layer >= self.layers:
            return
        if q is None:
            raise RuntimeError(f"layer {layer}'s attention was called without queries")
        heads, dim = module.tp_q_head_num, module.qk_head_dim
        qs = q.reshape(q.shape[0], heads, dim)[self.query_rows]
        keys = PoolKeys(self.pool.get_key_buffer(module.layer_id), self.key_slots)
        key_row = keys.buffer[0].numel() * keys.buffer.element_size()
        tile = probe_tile(heads * qs.shape[0], key_row, self.staging_bytes)
        self._total += question_attention(
            qs, keys, self.query_pos, module.scaling, first_pos=self.first_pos, tile=tile
        )
        self._seen.add(layer)

    @property
    def scores(self) -> torch.Tensor:
        """# [num_tokens] float32 on the host: the question's attention summed over the
        layers and (across tensor-parallel ranks) every head. One host read; a pass of
        several probes reads them all at once with ``host_scores``."""
        return host_scores([self])[0]

    def _device_total(self) -> torch.Tensor:
        """# [num_tokens] the summed attention where the pool is, this rank's heads."""
        if self._seen != set(range(self.layers)):
            missing = sorted(set(range(self.layers)) - self._seen)
            raise RuntimeError(f"the query probe did not see the attention of layers {missing}")
        return self._total


def host_scores(probes: Sequence[QueryProbe]) -> list[torch.Tensor]:
    """Each probe's ``scores`` (# [num_tokens] float32 on the host), for the probes of one
    pass: one reduction over the ranks and one host read for all of them, not one each
    (each read waits for the device). Forward thread, after the pass."""
    if not probes:
        return []
    reduce = probes[0].reduce
    if any(p.reduce is not reduce for p in probes):
        raise ValueError("the probes of one pass must share one reduce")
    totals = [p._device_total() for p in probes]
    flat = torch.cat(totals)
    if reduce is not None:
        flat = reduce(flat)  # a sum over ranks, token by token: the same on the joined totals
    return list(flat.cpu().split([t.numel() for t in totals]))


class ProbeCut:
    """Ends a probe pass after layer ``layers - 1``'s attention. Registered after the
    probes of the pass, so that each has scored that layer first."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def after_attention(self, layer: int, module: Any, q: torch.Tensor | None) -> None:
        if layer >= self.layers - 1:
            raise ProbeDone
