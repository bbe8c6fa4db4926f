"""Collectives over the tensor-parallel ranks that the chunk path runs outside SGLang's
forwards: a sum of a device signal, and a maximum of small host decisions."""

from __future__ import annotations

import torch


def tp_sum(t: torch.Tensor) -> torch.Tensor:
    """# same shape as ``t``: its sum over the tensor-parallel ranks."""
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(t.clone())


def tp_max(t: torch.Tensor) -> torch.Tensor:
    """# same shape as ``t`` (a small int64 host tensor): its elementwise maximum over the
    tensor-parallel ranks, through the TP group's gloo CPU group, as SGLang's scheduler
    makes its ranks reject the same requests before any model collective
    (``scheduler_components.request_receiver``): no device sync, nothing on the stream
    SGLang's forwards use."""
    from sglang.srt.distributed import get_tp_group

    out = t.clone()
    torch.distributed.all_reduce(
        out, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group
    )
    return out
