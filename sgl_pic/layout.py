"""Where the chunks of a prompt lie: validated token spans.

A prompt is a token sequence covered by ordered segments. A *chunk* segment is
reusable: its KV may come from the chunk cache, encoded independently. A *fresh*
segment (text outside any chunk mark, e.g. the question) has no cached KV and is
always computed in full, as an engine prefills uncached text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class LayoutError(ValueError):
    """Malformed chunk marks: unbalanced, overlapping, out of range or empty."""


# A lone UTF-16 surrogate: what json.loads makes of an unpaired "\ud800" escape (a pair
# becomes one code point). Not valid Unicode: it cannot be encoded as UTF-8 or tokenized.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, where: str) -> None:
    """Raises LayoutError when ``text`` holds a lone UTF-16 surrogate (not valid Unicode:
    it cannot be encoded as UTF-8, nor tokenized)."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise LayoutError(
            f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate "
            f"({m.group()!r} at character {m.start()}); send each surrogate in a pair, or the "
            "character itself as UTF-8"
        )


@dataclass(frozen=True)
class Span:
    """Half-open token range [start, end) of one segment."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Segment:
    """One piece of the prompt, in order."""

    span: Span
    reusable: bool


@dataclass(frozen=True)
class PromptLayout:
    """Validated chunk spans of a prompt of ``num_tokens`` tokens.

    chunks are sorted, non-empty, non-overlapping and inside [0, num_tokens);
    the tokens they leave uncovered are fresh.
    """

    num_tokens: int
    chunks: tuple[Span, ...]

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise LayoutError(f"a prompt needs at least one token, got {self.num_tokens}")
        prev_end = 0
        for i, span in enumerate(self.chunks):
            if span.start < 0 or span.end > self.num_tokens:
                raise LayoutError(
                    f"chunk {i} [{span.start}, {span.end}) is out of range for "
                    f"{self.num_tokens} tokens"
                )
            if span.length <= 0:
                raise LayoutError(f"chunk {i} [{span.start}, {span.end}) is empty")
            if span.start < prev_end:
                raise LayoutError(
                    f"chunk {i} [{span.start}, {span.end}) overlaps or precedes the chunk "
                    f"before it (which ends at {prev_end}); chunks must be sorted and disjoint"
                )
            prev_end = span.end

    @classmethod
    def from_spans(cls, num_tokens: int, spans: Sequence[Sequence[int]]) -> PromptLayout:
        """Build from ``[[start, end], ...]`` as sent over an API."""
        parsed = []
        for i, pair in enumerate(spans):
            # type() rather than isinstance: JSON's true is not a token index.
            if len(pair) != 2 or not all(type(v) is int for v in pair):
                raise LayoutError(f"chunk {i} must be a pair of integers [start, end], got {pair}")
            parsed.append(Span(int(pair[0]), int(pair[1])))
        return cls(num_tokens, tuple(parsed))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], fresh_tail: int = 0) -> PromptLayout:
        """Consecutive chunks of the given lengths, then ``fresh_tail`` fresh tokens."""
        spans, pos = [], 0
        for n in lengths:
            spans.append(Span(pos, pos + n))
            pos += n
        return cls(pos + fresh_tail, tuple(spans))

    def segments(self) -> tuple[Segment, ...]:
        """Every piece of the prompt in order: chunks and the fresh gaps between them."""
        out: list[Segment] = []
        pos = 0
        for span in self.chunks:
            if span.start > pos:
                out.append(Segment(Span(pos, span.start), reusable=False))
            out.append(Segment(span, reusable=True))
            pos = span.end
        if pos < self.num_tokens:
            out.append(Segment(Span(pos, self.num_tokens), reusable=False))
        return tuple(out)

    def fresh_indices(self) -> list[int]:
        """Token indices no chunk covers; they are always computed."""
        return [
            i
            for seg in self.segments()
            if not seg.reusable
            for i in range(seg.span.start, seg.span.end)
        ]

    @property
    def num_reusable(self) -> int:
        return sum(span.length for span in self.chunks)


class PaddedPrompt(NamedTuple):
    """A prompt whose chunk starts were moved onto page boundaries by fresh padding."""

    token_ids: list[int]
    layout: PromptLayout


def pad_chunk_starts(
    token_ids: Sequence[int], layout: PromptLayout, page_size: int, pad_id: int
) -> PaddedPrompt:
    """Insert ``pad_id`` tokens right before each chunk so every chunk starts on a multiple
    of ``page_size`` (DARIC 3.3.1: block-aligned chunks fill whole KV pages, so a chunk's
    independent KV can be kept and served as pages by unmodified paged kernels).

    Padding goes into the fresh text in front of a chunk (between two adjacent chunks if
    there is no fresh text), so it is fresh and always computed. Chunk tokens are copied
    unchanged and in order, as are fresh tokens; only positions move. A chunk that already
    starts on a page boundary gets no padding; ``page_size == 1`` returns the prompt as is.
    Chunk ends are not padded: the fresh text after a chunk shares its last page.

    Raises ValueError for ``page_size < 1`` or ``pad_id < 0``, and LayoutError when
    ``token_ids`` does not have ``layout.num_tokens`` tokens.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if pad_id < 0:
        raise ValueError(f"pad_id must be a token id >= 0, got {pad_id}")
    if len(token_ids) != layout.num_tokens:
        raise LayoutError(
            f"the layout covers {layout.num_tokens} tokens but the prompt has {len(token_ids)}"
        )
    if page_size == 1:
        return PaddedPrompt(list(token_ids), layout)
    out: list[int] = []
    chunks: list[Span] = []
    pos = 0  # next unread index of token_ids
    for span in layout.chunks:
        out.extend(token_ids[pos : span.start])
        out.extend([pad_id] * (-len(out) % page_size))
        start = len(out)
        out.extend(token_ids[span.start : span.end])
        chunks.append(Span(start, len(out)))
        pos = span.end
    out.extend(token_ids[pos:])
    return PaddedPrompt(out, PromptLayout(len(out), tuple(chunks)))
