"""One frozen settings object for chunk reuse, validated at construction.

Every algorithm reads its knobs from here; nothing reads environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

POLICY_NAMES: tuple[str, ...] = (
    "full_recompute",
    "full_reuse",
    "epic",
    "cacheblend",
    "daric",
    "cachetune",
)
MTAF_NAMES: tuple[str, ...] = ("linear", "log", "exp")


@dataclass(frozen=True)
class PicConfig:
    """Settings of position-independent reuse.

    policy:            name of the token-selection policy (see ``POLICY_NAMES``).
    daric_r:           DARIC's initial ratio r: chunk 2 gets r * n_avg tokens, in (0, 1].
    daric_n_avg:       DARIC's average per-chunk budget n_avg (tokens), >= 0.
    daric_mtaf:        DARIC's monotonic token allocation function: linear, log or exp.
    daric_max_iters:   merge-and-compensate rounds of DARIC's Algorithm 1.
    epic_k:            EPIC: first k tokens of every chunk but the first.
    cacheblend_ratio:  CacheBlend: fraction of reused tokens recomputed, in (0, 1].
    cachetune_r:       CacheTune: fraction of each chunk recomputed, in (0, 1].
    cachetune_alpha:   CacheTune: fraction of low-frequency rFFT bins kept, in (0, 1].
    segment_tokens:    longest cached segment (DARIC 3.3.2), tokens.
    page_size:         KV page size; chunk starts are padded to it.
    delimiter:         text marking chunk boundaries in plain-text prompts.
    """

    policy: str = "daric"
    daric_r: float = 0.1
    daric_n_avg: float = 32.0
    daric_mtaf: str = "linear"
    daric_max_iters: int = 3
    epic_k: int = 32
    cacheblend_ratio: float = 0.15
    cachetune_r: float = 0.15
    cachetune_alpha: float = 0.5
    segment_tokens: int = 256
    page_size: int = 1
    delimiter: str = "<|pic_chunk|>"

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(
                f"unknown policy {self.policy!r}; valid policies: {', '.join(POLICY_NAMES)}"
            )
        if self.daric_mtaf not in MTAF_NAMES:
            raise ValueError(
                f"unknown MTAF {self.daric_mtaf!r}; valid MTAFs: {', '.join(MTAF_NAMES)}"
            )
        _check_fraction("daric_r", self.daric_r)
        _check_fraction("cacheblend_ratio", self.cacheblend_ratio)
        _check_fraction("cachetune_r", self.cachetune_r)
        _check_fraction("cachetune_alpha", self.cachetune_alpha)
        if not self.daric_n_avg >= 0:
            raise ValueError(f"daric_n_avg must be >= 0, got {self.daric_n_avg}")
        if self.daric_max_iters < 0:
            raise ValueError(f"daric_max_iters must be >= 0, got {self.daric_max_iters}")
        if self.epic_k < 0:
            raise ValueError(f"epic_k must be >= 0, got {self.epic_k}")
        if self.segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {self.segment_tokens}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.delimiter:
            raise ValueError("delimiter must be a non-empty string")

    def with_overrides(self, **overrides: Any) -> PicConfig:
        """A validated copy with some settings replaced (per-request overrides)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown setting(s) {unknown}; valid settings: {', '.join(sorted(known))}"
            )
        return replace(self, **overrides)


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
