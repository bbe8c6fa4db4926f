"""DARIC's distribution-aware token selection (Section 3.2, Eq. 4, Algorithm 1).

Segment i (1-based, of M = ``len(layout.segments())``; chunks and fresh gaps alike)
gets its first n_i tokens recomputed for i = 2..M, and the last n_l tokens of the
prompt (the latest window) are recomputed too, with

    n_i = a f(i) + b,      n_2 = r n_avg,      n_M = n_l,
    sum_{i=2..M} n_i + n_l = M n_avg,

i.e. Eq. 4, A x = c with x = (a, b, n_l):

    [ f(M)                1      -1 ] [a  ]   [ 0       ]
    [ f(2)                1       0 ] [b  ] = [ r n_avg ]
    [ sum_{i=2..M} f(i)   M - 1   1 ] [n_l]   [ M n_avg ]

Substituting the first two rows into the third gives the closed form used here:

    n_i = r n_avg + a (f(i) - f(2)),    a = M n_avg (1 - r) / D,
    D   = sum_{i=2..M} (f(i) - f(2)) + (f(M) - f(2)).

It only involves differences of f divided by D, so it is unchanged when f is scaled
by a positive constant or shifted. The exponential MTAF is therefore evaluated as
f(x) = e^(x - M) (= e^x / e^M), which never overflows; a and b are reported for that
scaled f (``mtaf_values``), for which they satisfy Eq. 4 exactly.

Edge cases (the paper leaves them open):

* M = 1: the only segment is the prompt's prefix, whose independently encoded KV
  (or fresh text, computed anyway) is already exact, so nothing is selected:
  a = b = n_l = 0.
* M = 2: A is singular (its a and b columns are proportional) and Eq. 4 is
  inconsistent unless r = 1. We keep n_2 = r n_avg and the total budget and drop
  n_M = n_l: a = 0, b = r n_avg, n_l = (2 - r) n_avg. Thus n_2 = r n_avg for every
  M >= 2, so Proposition 1 holds at i = 2 with equality.
* Negative solutions cannot occur for a strictly increasing f with r in (0, 1] and
  n_avg >= 0 (then a >= 0 and n_i >= n_2 = r n_avg >= 0); round-off is clipped at 0.
* Token counts are floors of the real solution (with a 1e-9 relative tolerance so
  that a value such as 2.9999999999 computed for 3 floors to 3); their sum never
  exceeds floor(M n_avg).
* A segment shorter than its n_i contributes all of its tokens; the shortfall is left
  to merge-and-compensate.
* The first segment is never selected: not by the latest window, not by
  compensation. It starts at position 0, so its cached KV is already the prefix KV
  and recomputing it would spend budget for nothing (DARIC: "the first chunk strictly
  matches the prefix and requires no recomputation"). The last token is the one
  exception, added by ``finalize``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sgl_pic.config import MTAF_NAMES, PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.selection.base import Selection, SelectionContext, SelectionPolicy
from sgl_pic.selection.registry import register_policy

# Relative tolerance of the floors: a count computed a hair below an integer is that integer.
_FLOOR_TOL = 1e-9


class DaricBudget(NamedTuple):
    """The solution of Eq. 4 for M segments.

    a, b:              coefficients of n_i = a f(i) + b, for f as in ``mtaf_values``
                       (e^x is scaled to e^(x - M)); both 0 when M = 1.
    n_latest:          real budget n_l of the latest window.
    per_chunk:         real budgets n_2..n_M (empty when M = 1).
    latest_tokens:     floor(n_l).
    per_chunk_tokens:  floor(n_2)..floor(n_M).
    total_tokens:      floor(M n_avg), the most tokens Algorithm 1 may select.
    """

    a: float
    b: float
    n_latest: float
    per_chunk: tuple[float, ...]
    latest_tokens: int
    per_chunk_tokens: tuple[int, ...]
    total_tokens: int


def mtaf_values(mtaf: str, num_chunks: int) -> tuple[float, ...]:
    """f(1)..f(M) of the named MTAF as used in the solve; e^x is scaled by e^-M."""
    _check_mtaf(mtaf)
    xs = range(1, num_chunks + 1)
    if mtaf == "linear":
        return tuple(float(x) for x in xs)
    if mtaf == "log":
        return tuple(math.log(x) for x in xs)
    return tuple(math.exp(x - num_chunks) for x in xs)


def daric_budget(num_chunks: int, n_avg: float, r: float, mtaf: str) -> DaricBudget:
    """Solve Eq. 4 for ``num_chunks`` = M segments; see the module docstring."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if not (math.isfinite(n_avg) and n_avg >= 0):
        raise ValueError(f"n_avg must be finite and >= 0, got {n_avg}")
    if not 0.0 < r <= 1.0:
        raise ValueError(f"r must be in (0, 1], got {r}")
    _check_mtaf(mtaf)
    m = num_chunks
    total_tokens = _floor(m * n_avg)
    if m == 1:
        return DaricBudget(0.0, 0.0, 0.0, (), 0, (), total_tokens)

    f = mtaf_values(mtaf, m)
    n_2 = r * n_avg
    if m == 2:
        a, b, n_latest = 0.0, n_2, (2.0 - r) * n_avg
        per_chunk = (n_2,)
    else:
        # Differences from f(2), f[1] being f(2): the closed form of the docstring.
        diffs = [f[i - 1] - f[1] for i in range(2, m + 1)]
        denom = math.fsum(diffs) + diffs[-1]
        a = m * n_avg * (1.0 - r) / denom
        b = n_2 - a * f[1]
        per_chunk = tuple(max(0.0, n_2 + a * d) for d in diffs)
        n_latest = per_chunk[-1]

    per_chunk_tokens = tuple(_floor(n) for n in per_chunk)
    latest_tokens = _floor(n_latest)
    # The tolerant floors could in principle round up past the cap; the latest window
    # absorbs that, so the guarantee |I| <= floor(M n_avg) holds unconditionally.
    latest_tokens = max(0, min(latest_tokens, total_tokens - sum(per_chunk_tokens)))
    return DaricBudget(
        a=a,
        b=b,
        n_latest=n_latest,
        per_chunk=per_chunk,
        latest_tokens=latest_tokens,
        per_chunk_tokens=per_chunk_tokens,
        total_tokens=total_tokens,
    )


def daric_select(layout: PromptLayout, config: PicConfig) -> Selection:
    """Algorithm 1: initial tokens of segments 2..M, the latest window, then
    merge-and-compensate; never more than floor(M n_avg) tokens, never the first
    segment (see the module docstring)."""
    segments = layout.segments()
    budget = daric_budget(len(segments), config.daric_n_avg, config.daric_r, config.daric_mtaf)
    num_tokens = layout.num_tokens
    floor_idx = segments[0].span.end  # first selectable index
    mask = torch.zeros(num_tokens, dtype=torch.bool)

    for seg, n_i in zip(segments[1:], budget.per_chunk_tokens, strict=True):
        mask[seg.span.start : seg.span.start + min(n_i, seg.span.length)] = True
    mask[max(floor_idx, num_tokens - budget.latest_tokens) : num_tokens] = True

    # The boolean mask is the merge: overlapping sets collapse into disjoint runs.
    for _ in range(config.daric_max_iters):
        missing = budget.total_tokens - int(mask.sum())
        if missing <= 0:
            break
        start = _last_run_start(mask)
        new_start = max(floor_idx, start - missing)
        if new_start >= start:
            break  # nothing left before the last run; more rounds cannot help
        mask[new_start:start] = True

    return Selection(mask.nonzero().flatten())


@register_policy
class Daric(SelectionPolicy):
    """DARIC's distribution-aware selection; knobs ``daric_*`` of the config."""

    name = "daric"

    def select(self, ctx: SelectionContext) -> Selection:
        return daric_select(ctx.layout, self.config)


def _last_run_start(mask: torch.Tensor) -> int:
    """Start of the last run of True in ``mask`` (# [num_tokens] bool); the prompt's
    end when there is none, so that compensation of an empty set grows the latest
    window."""
    selected = mask.nonzero().flatten()
    if selected.numel() == 0:
        return mask.numel()
    gaps = (selected[1:] - selected[:-1] != 1).nonzero().flatten()
    if gaps.numel() == 0:
        return int(selected[0])
    return int(selected[int(gaps[-1]) + 1])


def _floor(x: float) -> int:
    return math.floor(x + _FLOOR_TOL * max(1.0, abs(x)))


def _check_mtaf(mtaf: str) -> None:
    if mtaf not in MTAF_NAMES:
        raise ValueError(f"unknown MTAF {mtaf!r}; valid MTAFs: {', '.join(MTAF_NAMES)}")
