"""Chunk marks of one request: parsed from the API, validated, carried to the scheduler.

They ride in ``sampling_params.custom_params`` (keys below) because SGLang
already carries that JSON dict unchanged from the HTTP server to the scheduler's ``Req``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sgl_pic.config import PicConfig
from sgl_pic.layout import LayoutError, PromptLayout

# custom_params values must be JSON scalars, flat lists or flat dicts (msgpack IPC), so the
# marks travel as three keys: flat [s0, e0, s1, e1, ...], the prompt length, overrides.
CHUNKS_KEY = "sgl_pic_chunks"
NUM_TOKENS_KEY = "sgl_pic_num_tokens"
CONFIG_KEY = "sgl_pic_config"
# Per-request overrides a client may send; server-only settings (page size, segment length,
# delimiter) are excluded because they change how chunks are keyed.
OVERRIDABLE = frozenset(
    {
        "policy",
        "daric_r",
        "daric_n_avg",
        "daric_mtaf",
        "daric_max_iters",
        "epic_k",
        "cacheblend_ratio",
        "cachetune_r",
        "cachetune_alpha",
    }
)


@dataclass(frozen=True)
class PicRequest:
    """layout: validated chunk spans; overrides: per-request PicConfig fields."""

    layout: PromptLayout
    overrides: Mapping[str, Any]

    def config(self, base: PicConfig) -> PicConfig:
        return base.with_overrides(**dict(self.overrides)) if self.overrides else base


def check_overrides(overrides: Any, base: PicConfig) -> dict[str, Any]:
    """Validated per-request overrides (raises LayoutError with a client-facing message)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise LayoutError(f"'config' must be an object, got {type(overrides).__name__}")
    bad = sorted(set(overrides) - OVERRIDABLE)
    if bad:
        raise LayoutError(
            f"settings {bad} cannot be overridden per request; allowed: {sorted(OVERRIDABLE)}"
        )
    try:
        base.with_overrides(**overrides)
    except (TypeError, ValueError) as e:
        raise LayoutError(str(e)) from e
    return dict(overrides)


def encode(layout: PromptLayout, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The custom_params entries for one request."""
    return {
        CHUNKS_KEY: [v for s in layout.chunks for v in (s.start, s.end)],
        NUM_TOKENS_KEY: layout.num_tokens,
        CONFIG_KEY: dict(overrides),
    }


def decode(custom_params: Mapping[str, Any] | None) -> PicRequest | None:
    """The request's chunk marks, or None for a plain request."""
    if not custom_params or CHUNKS_KEY not in custom_params:
        return None
    flat = list(custom_params[CHUNKS_KEY])
    pairs = [flat[i : i + 2] for i in range(0, len(flat), 2)]
    layout = PromptLayout.from_spans(int(custom_params[NUM_TOKENS_KEY]), pairs)
    return PicRequest(layout, dict(custom_params.get(CONFIG_KEY) or {}))


def split_on_delimiter(
    text: str, delimiter: str, tokenize: Callable[[str, bool], list[int]]
) -> tuple[list[int], PromptLayout]:
    """Token ids and chunk spans of ``text`` whose chunks are enclosed in delimiter pairs.

    ``before <d>chunk A<d> between <d>chunk B<d> after``: the delimiters alternate open and
    close. Each piece is tokenized on its own (``tokenize(piece, is_first)``), so a chunk's
    tokens, and hence its cache key, never depend on the text around it.
    """
    pieces = text.split(delimiter)
    if len(pieces) % 2 == 0:
        raise LayoutError(
            f"unbalanced chunk delimiters: {len(pieces) - 1} occurrence(s) of {delimiter!r}; "
            "each chunk needs an opening and a closing delimiter"
        )
    ids: list[int] = []
    spans: list[list[int]] = []
    for i, piece in enumerate(pieces):
        is_chunk = i % 2 == 1
        toks = tokenize(piece, i == 0) if piece else []
        if is_chunk:
            if not toks:
                raise LayoutError(f"chunk {len(spans)} is empty (nothing between delimiters)")
            spans.append([len(ids), len(ids) + len(toks)])
        ids.extend(toks)
    if not ids:
        raise LayoutError("the prompt is empty")
    return ids, PromptLayout.from_spans(len(ids), spans)


def layout_from_spans(input_ids: Sequence[int], chunks: Any) -> PromptLayout:
    """Validated layout of explicit ``[[start, end], ...]`` spans over ``input_ids``."""
    if not isinstance(chunks, list):
        raise LayoutError(f"'chunks' must be a list of [start, end] pairs, got {chunks!r}")
    for i, pair in enumerate(chunks):
        if not isinstance(pair, list | tuple):
            raise LayoutError(f"chunk {i} must be a pair of integers [start, end], got {pair!r}")
    return PromptLayout.from_spans(len(input_ids), chunks)
