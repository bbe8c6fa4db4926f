"""Chunked prompts from RAG examples: token-exact chunk boundaries.

Each piece is tokenized on its own and the ids are concatenated, so a chunk's ids are
identical in every prompt it appears in (the precondition of reuse). The layout is:
system header (chunk; it sits at position 0 so it equals the prefix exactly), one chunk
per passage, then the question and the assistant header as fresh text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_pic.layout import PromptLayout, Span

SYSTEM_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant. Answer the question using the "
    "passages. Answer with a few words only.<|im_end|>\n<|im_start|>user\n"
)
PASSAGE_TEMPLATE = "Passage: {text}\n\n"
QUESTION_TEMPLATE = "Question: {question}\nAnswer:<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class RagExample:
    question: str
    answers: tuple[str, ...]
    passages: tuple[str, ...]


@dataclass(frozen=True)
class ChunkedPrompt:
    token_ids: torch.Tensor  # [num_tokens] int64
    layout: PromptLayout


def load_rag_examples(path: str | Path) -> list[RagExample]:
    """Examples of the shape ``{"question", "answers": [...], "ctxs": [{"title", "text"}]}``."""
    with open(path) as f:
        raw: list[dict[str, Any]] = json.load(f)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a JSON list of examples")
    out = []
    for i, ex in enumerate(raw):
        try:
            passages = tuple(
                (c.get("title", "") + "\n" if c.get("title") else "") + c["text"]
                for c in ex["ctxs"]
            )
            out.append(RagExample(ex["question"], tuple(ex["answers"]), passages))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: example {i} is malformed ({e!r})") from e
    return out


def truncate_tokens(tokenizer: Any, text: str, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens (unchanged if shorter or if
    ``max_tokens`` <= 0): the benchmarks' knob for prompt length at a fixed chunk count."""
    if max_tokens <= 0:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def build_prompt(
    tokenizer: Any,
    passages: Sequence[str],
    question: str,
    system_text: str = SYSTEM_TEXT,
) -> ChunkedPrompt:
    """System chunk, one chunk per passage, fresh question tail."""

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    pieces = [ids(system_text)] + [ids(PASSAGE_TEMPLATE.format(text=p)) for p in passages]
    tail = ids(QUESTION_TEMPLATE.format(question=question))
    spans, pos, flat = [], 0, []
    for piece in pieces:
        spans.append(Span(pos, pos + len(piece)))
        flat.extend(piece)
        pos += len(piece)
    flat.extend(tail)
    return ChunkedPrompt(
        torch.tensor(flat, dtype=torch.int64), PromptLayout(len(flat), tuple(spans))
    )
