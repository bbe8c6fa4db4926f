"""One frozen settings object for chunk reuse, validated at construction.

Every algorithm reads its knobs from here; nothing reads environment variables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from sgl_pic.registry import POLICIES

MTAF_NAMES: tuple[str, ...] = ("linear", "log", "exp")
# The settings each policy's selection reads: requests that agree on them build the same
# approximation, so they may share prefix KV (see ``approximation_key``).
POLICY_FIELDS: dict[str, tuple[str, ...]] = {
    "full_recompute": (),
    "full_reuse": (),
    "epic": ("epic_k",),
    "cacheblend": ("cacheblend_ratio",),
    "daric": ("daric_r", "daric_n_avg", "daric_mtaf", "daric_max_iters"),
    "cachetune": ("cachetune_r", "cachetune_alpha"),
    "query_aware": ("qa_ratio", "qa_min_tokens", "qa_sink_tokens", "qa_layers"),
}
# Policies with a budget ratio that recomputes every reused token at 1.0 (``exact``).
FULL_BUDGET_FIELDS: dict[str, str] = {
    "cachetune": "cachetune_r",
    "cacheblend": "cacheblend_ratio",
    "query_aware": "qa_ratio",
}
# Upper bounds keep one request from buying unbounded scheduler work (DARIC's merge
# rounds, budgets far past any chunk) with a single number.
MAX_BUDGET_TOKENS = 1 << 20
MAX_DARIC_ITERS = 16
MAX_QA_LAYERS = 16


@dataclass(frozen=True)
class PicConfig:
    """Settings of position-independent reuse.

    policy:            name of a registered token-selection policy (``registry.POLICIES``).
    daric_r:           DARIC's initial ratio r: chunk 2 gets r * n_avg tokens, in (0, 1].
    daric_n_avg:       DARIC's average per-chunk budget n_avg (tokens), >= 0.
    daric_mtaf:        DARIC's monotonic token allocation function: linear, log or exp.
    daric_max_iters:   merge-and-compensate rounds of DARIC's Algorithm 1.
    epic_k:            EPIC: first k tokens of every chunk but the first.
    cacheblend_ratio:  CacheBlend: fraction of reused tokens recomputed, in (0, 1].
    cachetune_r:       CacheTune: fraction of each chunk recomputed, in (0, 1].
    cachetune_alpha:   CacheTune: fraction of low-frequency rFFT bins kept, in (0, 1].
    qa_ratio:          query_aware: fraction of reused tokens recomputed, in (0, 1].
    qa_min_tokens:     query_aware: the budget is at least this many tokens per reused
                       chunk (short chunks lose more to their boundaries than a fraction
                       of their length covers).
    qa_sink_tokens:    query_aware: first tokens of every reused chunk always recomputed
                       (within the budget).
    qa_layers:         query_aware: early layers whose question attention ranks tokens.
    segment_tokens:    longest cached segment (DARIC 3.3.2), tokens.
    page_size:         KV page size; chunk starts are padded to it.
    delimiter:         text marking chunk boundaries in plain-text prompts.
    max_chunks:        most chunks one request may mark (a prompt of thousands of tiny
                       chunks would stall the scheduler on lookups and phase sub-requests).
    min_chunk_tokens:  fewest tokens a chunk may have.
    auto_chunk_min_tokens: fewest tokens of a text auto-chunking makes a chunk (at least
                       ``min_chunk_tokens`` in effect); shorter texts stay fresh. Reuse
                       saves little on them (query_aware recomputes ``qa_min_tokens`` of
                       every reused chunk, DARIC its first tokens), while each costs a
                       lookup, a node and, on first sight, a phase-1 forward.
    """

    policy: str = "query_aware"
    daric_r: float = 0.1
    daric_n_avg: float = 32.0
    daric_mtaf: str = "linear"
    daric_max_iters: int = 3
    epic_k: int = 32
    cacheblend_ratio: float = 0.15
    cachetune_r: float = 0.15
    cachetune_alpha: float = 0.5
    qa_ratio: float = 0.15
    qa_min_tokens: int = 16
    qa_sink_tokens: int = 1
    qa_layers: int = 6
    segment_tokens: int = 256
    page_size: int = 1
    delimiter: str = "<|pic_chunk|>"
    max_chunks: int = 256
    min_chunk_tokens: int = 4
    auto_chunk_min_tokens: int = 32

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, f.type)
            if f.type == "float":
                # 32 and 32.0 are one budget: one value, one approximation key.
                object.__setattr__(self, f.name, float(value))
        POLICIES.check(self.policy)  # UnknownNameError is a ValueError
        if self.daric_mtaf not in MTAF_NAMES:
            raise ValueError(
                f"unknown MTAF {self.daric_mtaf!r}; valid MTAFs: {', '.join(MTAF_NAMES)}"
            )
        _check_fraction("daric_r", self.daric_r)
        _check_fraction("cacheblend_ratio", self.cacheblend_ratio)
        _check_fraction("cachetune_r", self.cachetune_r)
        _check_fraction("cachetune_alpha", self.cachetune_alpha)
        _check_fraction("qa_ratio", self.qa_ratio)
        _check_range("qa_min_tokens", self.qa_min_tokens, 0, MAX_BUDGET_TOKENS)
        _check_range("qa_sink_tokens", self.qa_sink_tokens, 0, MAX_BUDGET_TOKENS)
        # The probe's cost grows with its depth; past a few layers it is a second prefill.
        _check_range("qa_layers", self.qa_layers, 1, MAX_QA_LAYERS)
        # n_avg = 0 would select nothing: that is full_reuse, asked for by name.
        _check_range("daric_n_avg", self.daric_n_avg, 0, MAX_BUDGET_TOKENS, low_open=True)
        _check_range("daric_max_iters", self.daric_max_iters, 0, MAX_DARIC_ITERS)
        _check_range("epic_k", self.epic_k, 0, MAX_BUDGET_TOKENS)
        _check_range("segment_tokens", self.segment_tokens, 1, MAX_BUDGET_TOKENS)
        _check_range("page_size", self.page_size, 1, 1 << 16)
        _check_range("max_chunks", self.max_chunks, 1, 1 << 16)
        _check_range("min_chunk_tokens", self.min_chunk_tokens, 1, MAX_BUDGET_TOKENS)
        _check_range("auto_chunk_min_tokens", self.auto_chunk_min_tokens, 1, MAX_BUDGET_TOKENS)
        if not self.delimiter:
            raise ValueError("delimiter must be a non-empty string")

    @property
    def exact(self) -> bool:
        """Whether this config recomputes every reused token, so its output is exact prefill:
        full_recompute, or a ratio policy at r = 1."""
        field = FULL_BUDGET_FIELDS.get(self.policy)
        return self.policy == "full_recompute" or (
            field is not None and getattr(self, field) == 1.0
        )

    def approximation_key(self) -> str:
        """Names the approximation this config's selection makes: ``exact``, or the policy
        with the settings it reads. Equal keys mean equal KV for equal chunks and hits."""
        if self.exact:
            return "exact"
        values = [repr(getattr(self, f)) for f in POLICY_FIELDS[self.policy]]
        return ",".join([self.policy, *values])

    def with_overrides(self, **overrides: Any) -> PicConfig:
        """A validated copy with some settings replaced (per-request overrides)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown setting(s) {unknown}; valid settings: {', '.join(sorted(known))}"
            )
        return replace(self, **overrides)


# Exact types per field annotation: JSON's true is not the integer 1, and NaN is no budget.
_TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "float": (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    "int": (lambda v: type(v) is int, "an integer"),
    "str": (lambda v: type(v) is str, "a string"),
}


def _check_type(name: str, value: Any, annotation: Any) -> None:
    check, what = _TYPE_CHECKS[str(annotation)]
    if not check(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
