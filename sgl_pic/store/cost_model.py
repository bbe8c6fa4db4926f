"""CacheTune's cost model and warm-started golden-section search for the recompute
ratio r (Section 4.3, Appendix C).

Per layer, r N tokens are recomputed (t_c each) while (1 - r) N tokens' KV are loaded
(t_i each) on an overlapping path, plus a fixed per-layer overhead t_o:

    TTFT(r) = L * (max(r N t_c, (1 - r) N t_i) + t_o)  [+ (1 - r) N t_i, see below]

The extracted paper text lost the displayed equation; this is the form its prose
describes (per-layer max of the overlapped paths, plus t_o). ``include_prologue`` adds
the first layer's load, which nothing overlaps in our pipeline. The balance point
r* = t_i / (t_c + t_i), clamped to [r_min, 1], warm-starts the golden-section search of
an empirical (or modelled) TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

PHI = (math.sqrt(5.0) - 1.0) / 2.0  # 0.618...


@dataclass(frozen=True)
class CostParams:
    """t_c: seconds to recompute one token for one layer.
    t_i:    seconds to load one token's K and V for one layer from the tier.
    t_o:    fixed seconds per layer (launches, event waits, buffer handling).
    num_layers, num_tokens: L and N, the reused tokens of a request.
    include_prologue: add the first layer's unoverlapped load.
    """

    t_c: float
    t_i: float
    t_o: float
    num_layers: int
    num_tokens: int
    include_prologue: bool = False

    def __post_init__(self) -> None:
        for name in ("t_c", "t_i", "t_o"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.num_layers < 1 or self.num_tokens < 1:
            raise ValueError(f"need L >= 1 and N >= 1, got {self.num_layers}, {self.num_tokens}")


def ttft(params: CostParams, r: float) -> float:
    """Modelled time to first token (seconds) at recompute ratio r in [0, 1]."""
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"r must be in [0, 1], got {r}")
    n = params.num_tokens
    compute = r * n * params.t_c
    load = (1.0 - r) * n * params.t_i
    total = params.num_layers * (max(compute, load) + params.t_o)
    return total + (load if params.include_prologue else 0.0)


def balance_ratio(params: CostParams, r_min: float = 0.0) -> float:
    """The r where compute and load paths take equally long, clamped to [r_min, 1]: the
    minimum of ``ttft`` without prologue, and the search's warm start."""
    denom = params.t_c + params.t_i
    r = 1.0 if denom == 0 else params.t_i / denom
    return min(1.0, max(r_min, r))


@dataclass(frozen=True)
class SearchConfig:
    """r_min:        quality floor on r (CacheTune uses 0.15).
    r_max:          upper end of the search (1 = recompute everything).
    tol:            stop when the bracket is narrower than this.
    warm_width:     half-width of the first bracket around the warm start.
    max_evals:      hard cap on objective evaluations (each may be a real TTFT run).
    """

    r_min: float = 0.15
    r_max: float = 1.0
    tol: float = 0.01
    warm_width: float = 0.1
    max_evals: int = 64

    def __post_init__(self) -> None:
        if not 0.0 <= self.r_min < self.r_max <= 1.0:
            raise ValueError(f"need 0 <= r_min < r_max <= 1, got {self.r_min}, {self.r_max}")
        if not self.tol > 0:
            raise ValueError(f"tol must be > 0, got {self.tol}")
        if not self.warm_width > 0:
            raise ValueError(f"warm_width must be > 0, got {self.warm_width}")
        if self.max_evals < 3:
            raise ValueError(f"max_evals must be >= 3, got {self.max_evals}")


class Probe(NamedTuple):
    r: float
    value: float


@dataclass(frozen=True)
class SearchResult:
    """r:          the chosen ratio: the midpoint of the final bracket, or the domain's
                edge when the best probe lies there.
    value:      the best objective value seen (at ``best_r``).
    bracket:    the final (lo, hi); the true minimiser of a unimodal objective is in it.
    probes:     every evaluation, in order.
    """

    r: float
    value: float
    best_r: float
    bracket: tuple[float, float]
    probes: tuple[Probe, ...]


class _Budget(Exception):
    pass


def golden_section(
    objective: Callable[[float], float],
    config: SearchConfig,
    warm_start: float | None = None,
) -> SearchResult:
    """Minimise a unimodal ``objective`` over [r_min, r_max].

    With ``warm_start``, the search first brackets the minimum around it (width
    ``2 * warm_width``, doubled outward while the edge probe is lower), then runs
    golden-section inside that bracket; each golden step evaluates one new point and
    reuses the other. Evaluations are cached by r, so a probe is never paid twice.
    """
    lo, hi = config.r_min, config.r_max
    probes: list[Probe] = []
    cache: dict[float, float] = {}

    def f(r: float) -> float:
        r = min(hi, max(lo, r))
        if r not in cache:
            if len(probes) >= config.max_evals:
                raise _Budget
            cache[r] = float(objective(r))
            probes.append(Probe(r, cache[r]))
        return cache[r]

    a, b = lo, hi
    try:
        if warm_start is not None:
            a, b = _bracket(f, min(hi, max(lo, warm_start)), config, lo, hi)
        x1, x2 = b - PHI * (b - a), a + PHI * (b - a)
        f1, f2 = f(x1), f(x2)
        while b - a > config.tol:
            if f1 <= f2:
                b, x2, f2 = x2, x1, f1
                x1 = b - PHI * (b - a)
                f1 = f(x1)
            else:
                a, x1, f1 = x1, x2, f2
                x2 = a + PHI * (b - a)
                f2 = f(x2)
    except _Budget:
        pass
    best = min(probes, key=lambda p: p.value)
    r = (a + b) / 2.0
    if best.r in (lo, hi) and a <= best.r <= b:
        # The minimum sits on the domain's edge (e.g. the quality floor r_min): the edge
        # itself, not a point tol/2 inside it, is the answer.
        r = best.r
    return SearchResult(r, best.value, best.r, (a, b), tuple(probes))


def _bracket(
    f: Callable[[float], float], x0: float, config: SearchConfig, lo: float, hi: float
) -> tuple[float, float]:
    """An interval around x0 whose interior probe x0 is no higher than either end, so
    a unimodal minimum lies inside; widened outward (doubling) while an end is lower."""
    w = config.warm_width
    fx = f(x0)
    a, b = max(lo, x0 - w), min(hi, x0 + w)
    while True:
        fa, fb = f(a), f(b)
        if fa < fx and a > lo:
            # The minimum may be left of a: move the centre there and widen.
            x0, fx, w = a, fa, 2 * w
            a, b = max(lo, x0 - w), min(hi, x0 + w)
        elif fb < fx and b < hi:
            x0, fx, w = b, fb, 2 * w
            a, b = max(lo, x0 - w), min(hi, x0 + w)
        else:
            if fa < fx:
                # a is the domain edge and lowest: the minimum is in [lo, x0].
                return lo, x0
            if fb < fx:
                return x0, hi
            return a, b


def choose_ratio(
    params: CostParams,
    config: SearchConfig,
    objective: Callable[[float], float] | None = None,
) -> SearchResult:
    """The deployment ratio for one tier: golden-section over ``objective`` (a measured
    TTFT at ratio r; the model's ``ttft`` when None), warm-started at the balance point."""
    obj = objective if objective is not None else (lambda r: ttft(params, r))
    return golden_section(obj, config, warm_start=balance_ratio(params, config.r_min))
