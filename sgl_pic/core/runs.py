"""Runs of recomputed positions and the extend sub-requests a phase forward is made of.

A request's recomputed positions become contiguous runs (``runs_of``); each run, and each
miss phase 1 encodes, is one ``SubRequest`` over a row of SGLang's request table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Run(NamedTuple):
    """Positions start..end-1 of one request, recomputed as one sub-request."""

    start: int
    end: int


def runs_of(positions: torch.Tensor, merge_gap: int = 0) -> list[Run]:
    """Half-open runs [start, end) covering the sorted distinct ``positions`` (# [k]);
    runs separated by at most ``merge_gap`` unselected tokens become one (those tokens
    are then recomputed too, which only brings the result closer to exact)."""
    if positions.numel() == 0:
        return []
    pos = positions.tolist()
    runs = [[pos[0], pos[0] + 1]]
    for p in pos[1:]:
        if p - runs[-1][1] <= merge_gap:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [Run(a, b) for a, b in runs]


class SubRequest(NamedTuple):
    """Queries at positions prefix..prefix+extend-1 of ``req_to_token[pool_idx]``; keys
    are that row's first prefix+extend slots, and the queries' K/V go to the row's slots
    prefix..prefix+extend-1."""

    pool_idx: int
    prefix: int
    extend: int


def attended_keys(subs: Sequence[SubRequest]) -> int:
    """Keys the queries of ``subs`` attend, summed: a query at position p sees its row's
    first p + 1 keys. Over the number of queries it is the attention work per computed
    token, which for a prompt prefilled whole is (len + 1) / 2."""
    return sum(s.extend * s.prefix + s.extend * (s.extend + 1) // 2 for s in subs)
