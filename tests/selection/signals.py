"""Shared pieces of the online-signal policy tests (CacheBlend's deviation, query_aware's
question attention)."""

from __future__ import annotations

import torch

from sgl_pic.layout import PromptLayout

# [chunk 0-10][chunk 10-20][fresh 20-25][chunk 25-35][fresh 35-37]
LAYOUT = PromptLayout.from_spans(37, [[0, 10], [10, 20], [25, 35]])


class CountingSignal:
    """A synthetic per-token signal (# [num_tokens]) that counts how often it is computed."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.values
