"""One frozen settings object for chunk reuse, validated at construction.

Every algorithm reads its knobs from here; nothing reads environment variables. Each field
is declared once (``sgl_pic.declare``); the launcher's flags, the README's flags table and
the per-request override rule (``REQUEST_OVERRIDES``) are produced from those declarations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from sgl_pic.declare import (
    Override,
    Setting,
    by_value,
    check_declared,
    declared,
    in_range,
    one_of,
    overridable,
    setting,
)
from sgl_pic.registry import POLICIES

MTAF_NAMES: tuple[str, ...] = ("linear", "log", "exp")
# What a chunk's stored KV is encoded after (``chunk_context``): nothing, or the prompt's
# tokens through its first chunk (``gate.Pending.context_of``).
CHUNK_CONTEXTS: tuple[str, ...] = ("none", "first_chunk")
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
_FRACTION = in_range(0, 1, low_open=True)


def _non_empty(name: str, value: str) -> None:
    if not value:
        raise ValueError(f"{name} must be a non-empty string")


@dataclass(frozen=True)
class PicConfig:
    """Settings of position-independent reuse: the server's defaults (flags), each request's
    copy with its overrides. Every field is declared once below (``sgl_pic.declare``): what
    it sets, its flag, its check and whether a request may override it; the server-only
    ones change how chunks are keyed, bounded or ranked when stored."""

    policy: str = setting(
        "query_aware",
        "token-selection policy (a name registered in ``registry.POLICIES``)",
        flag="--pic-policy",
        choices=POLICIES.names,
        check=by_value(POLICIES.check),  # UnknownNameError is a ValueError
        override=Override.CONFIG,
    )
    daric_r: float = setting(
        0.1,
        "DARIC: initial ratio r, chunk 2 gets r * n_avg tokens, in (0, 1]",
        flag="--pic-r",
        check=_FRACTION,
        override=Override.CONFIG,
    )
    daric_n_avg: float = setting(
        32.0,
        "DARIC: average per-chunk budget n_avg, tokens",
        flag="--pic-n-avg",
        # n_avg = 0 would select nothing: that is full_reuse, asked for by name.
        check=in_range(0, MAX_BUDGET_TOKENS, low_open=True),
        override=Override.CONFIG,
    )
    daric_mtaf: str = setting(
        "linear",
        "DARIC: monotonic token allocation function",
        flag="--pic-mtaf",
        choices=MTAF_NAMES,
        check=one_of(MTAF_NAMES, "MTAF", "MTAFs"),
        override=Override.CONFIG,
    )
    daric_max_iters: int = setting(
        3,
        "DARIC: merge-and-compensate rounds of its Algorithm 1",
        flag="--pic-max-iters",
        check=in_range(0, MAX_DARIC_ITERS),
        override=Override.CONFIG,
    )
    epic_k: int = setting(
        32,
        "EPIC: first k tokens of every chunk but the first are recomputed",
        flag="--pic-epic-k",
        check=in_range(0, MAX_BUDGET_TOKENS),
        override=Override.CONFIG,
    )
    cacheblend_ratio: float = setting(
        0.15,
        "CacheBlend: fraction of reused tokens recomputed, in (0, 1]",
        flag="--pic-cacheblend-ratio",
        check=_FRACTION,
        override=Override.CONFIG,
    )
    cachetune_r: float = setting(
        0.15,
        "CacheTune: fraction of each chunk recomputed, in (0, 1]",
        flag="--pic-cachetune-r",
        check=_FRACTION,
        override=Override.CONFIG,
    )
    cachetune_alpha: float = setting(
        0.5,
        "CacheTune: fraction of low-frequency rFFT bins kept, in (0, 1] (part of every "
        "chunk key, so server-wide)",
        flag="--pic-alpha",
        check=_FRACTION,
    )
    qa_ratio: float = setting(
        0.15,
        "query_aware: fraction of reused tokens recomputed, in (0, 1]",
        flag="--pic-qa-ratio",
        check=_FRACTION,
        override=Override.CONFIG,
    )
    qa_min_tokens: int = setting(
        16,
        "query_aware: the budget is at least this many tokens per reused chunk (short "
        "chunks lose more to their boundaries than a fraction of their length covers)",
        flag="--pic-qa-min-tokens",
        check=in_range(0, MAX_BUDGET_TOKENS),
        override=Override.CONFIG,
    )
    qa_sink_tokens: int = setting(
        1,
        "query_aware: first tokens of every reused chunk always recomputed (within the budget)",
        flag="--pic-qa-sink-tokens",
        check=in_range(0, MAX_BUDGET_TOKENS),
        override=Override.CONFIG,
    )
    qa_layers: int = setting(
        6,
        "query_aware: early layers whose question attention ranks tokens (the probe's depth)",
        flag="--pic-qa-layers",
        # The probe's cost grows with its depth; past a few layers it is a second prefill.
        check=in_range(1, MAX_QA_LAYERS),
        override=Override.CONFIG,
    )
    chunk_context: str = setting(
        "none",
        "what each chunk past a prompt's first is encoded after: none (alone, from position "
        "0) or first_chunk (after the prompt's tokens through its first chunk, a shared "
        "prefix such as a system prompt; the chunk's key names those tokens, so it is "
        "reused only behind the same ones)",
        flag="--pic-chunk-context",
        choices=CHUNK_CONTEXTS,
        check=one_of(CHUNK_CONTEXTS, "chunk context", "contexts"),
    )
    segment_tokens: int = setting(
        256,
        "longest cached segment (DARIC 3.3.2), tokens; longer chunks are cut into windows",
        flag="--pic-segment-tokens",
        check=in_range(1, MAX_BUDGET_TOKENS),
    )
    page_size: int = setting(
        1,
        "KV page size chunk starts are padded to: SGLang's resolved --page-size",
        check=in_range(1, 1 << 16),
    )
    delimiter: str = setting(
        "<|pic_chunk|>",
        "text marking chunk boundaries in plain-text prompts",
        flag="--pic-delimiter",
        check=_non_empty,
    )
    max_chunks: int = setting(
        256,
        "most chunks one request may mark (thousands of tiny chunks would stall the "
        "scheduler on lookups and phase sub-requests)",
        flag="--pic-max-chunks",
        check=in_range(1, 1 << 16),
    )
    min_chunk_tokens: int = setting(
        4,
        "fewest tokens a marked chunk may have",
        flag="--pic-min-chunk-tokens",
        check=in_range(1, MAX_BUDGET_TOKENS),
    )
    auto_chunk_min_tokens: int = setting(
        32,
        "fewest tokens of a message text auto-chunking makes a chunk (at least "
        "--pic-min-chunk-tokens in effect); shorter texts stay fresh (reuse saves little on "
        "them, while each chunk costs a lookup, a node and a phase-1 forward)",
        flag="--pic-auto-chunk-min-tokens",
        check=in_range(1, MAX_BUDGET_TOKENS),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, f.type)
            if f.type == "float":
                # 32 and 32.0 are one budget: one value, one approximation key.
                object.__setattr__(self, f.name, float(value))
        check_declared(self, CONFIG_SETTINGS)
        if self.chunk_context != "none" and self.page_size != 1:
            # Phase 1 lays a chunk's slots right after its context's in a request-table
            # row; with pages, a context that ends inside one would misalign them.
            raise ValueError(
                f"chunk_context {self.chunk_context!r} needs page size 1, got {self.page_size}"
            )

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
        if self.chunk_context != "none":
            # Chunks encoded after another context hold other KV.
            values.append(f"context={self.chunk_context}")
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


# The declarations of PicConfig's fields, in field order.
CONFIG_SETTINGS: tuple[Setting, ...] = declared(PicConfig)
# Settings a request may override (``"pic": {"config": {...}}``); the rest are server-wide.
REQUEST_OVERRIDES: frozenset[str] = overridable(PicConfig)
