"""Host-to-device copies that never make the host wait."""

from __future__ import annotations

import torch


def pinnable(device: torch.device) -> bool:
    """Whether copies to ``device`` go through pinned host memory: CUDA's only (on a CPU
    "device" there is nothing to copy)."""
    return device.type == "cuda"


def to_device(
    host: torch.Tensor,  # [...] host tensor
    device: torch.device,
) -> torch.Tensor:
    """# [...] ``host`` on ``device``, without the host waiting: a copy from pageable
    memory blocks until the stream reaches it, one from pinned memory with ``non_blocking``
    does not (the caching host allocator keeps the pinned block until the copy has run)."""
    if not pinnable(device):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
