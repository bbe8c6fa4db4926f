"""The model's tokenizer as the HTTP edge uses it: loaded on first use, it tokenizes
prompt pieces (refusing text that is not valid Unicode), finds what it adds around a
whole prompt, pads chunk starts to the KV page size, and checks token ids against the
vocabulary. Runs in the server's HTTP process; the scheduler checks the ids again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgl_pic.config import PicConfig
from sgl_pic.core.spans import SpecialTokens, special_tokens
from sgl_pic.layout import (
    LayoutError,
    PaddedPrompt,
    PromptLayout,
    check_unicode,
    pad_chunk_starts,
)


class PromptTokens:
    """config:         the server's settings (its page size pads chunk starts).
    load_tokenizer(): the model's HF tokenizer (``__call__``); called on first use.
    vocab_size:     the model's vocabulary; token ids outside it are refused (None:
                    unchecked here, the scheduler still checks)."""

    def __init__(
        self,
        config: PicConfig,
        load_tokenizer: Callable[[], Any],
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._specials: SpecialTokens | None = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def pad_id(self) -> int:
        """The token that pads chunk starts to a page boundary: the tokenizer's pad token,
        else its EOS token."""
        tok = self.tokenizer
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, name, None)
            if isinstance(value, int) and value >= 0:
                return value
        raise LayoutError(
            f"page size {self.config.page_size} needs a token to pad chunk starts with, but "
            "the tokenizer has neither a pad_token_id nor an eos_token_id"
        )

    def align(self, ids: list[int], layout: PromptLayout) -> PaddedPrompt:
        """``ids`` and ``layout`` with chunk starts padded to the KV page size; unchanged
        for a page size of 1 (which then needs no pad token)."""
        if self.config.page_size == 1:
            return PaddedPrompt(ids, layout)
        return pad_chunk_starts(ids, layout, self.config.page_size, self.pad_id())

    def _tokenize(self, text: str, special: bool) -> list[int]:
        check_unicode(text, "a prompt text")
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def chunk_ids(self, text: str) -> list[int]:
        """A marked chunk's token ids, as ``generate`` tokenizes the text between two
        delimiters (on its own, no special tokens); raises LayoutError for text that is
        not valid Unicode."""
        return self._tokenize(text, False)

    @property
    def specials(self) -> SpecialTokens:
        """What the tokenizer adds around a whole prompt (e.g. BOS)."""
        if self._specials is None:
            self._specials = special_tokens(self._tokenize)
        return self._specials

    def check_ids(self, ids: Any, field: str) -> None:
        """Raises LayoutError unless ``ids`` is a non-empty list of token ids in the
        vocabulary (``field`` names it in the message)."""
        if not isinstance(ids, list) or not ids:
            raise LayoutError(f"'{field}' must be a non-empty list of token ids")
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise LayoutError(f"'{field}'[{i}] must be an integer token id, got {t!r}")
            if t < 0 or (self.vocab_size is not None and t >= self.vocab_size):
                raise LayoutError(
                    f"'{field}'[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})"
                )

    def check_id_lists(self, value: Any, field: str) -> None:
        """``value`` as a request's token ids: one list, or a batch of lists."""
        if isinstance(value, list) and value and isinstance(value[0], list):
            for b, ids in enumerate(value):
                self.check_ids(ids, f"{field}[{b}]")
        else:
            self.check_ids(value, field)
