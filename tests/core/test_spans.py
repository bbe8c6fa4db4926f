"""Chunk starts padded to the KV page size by the request rewrite (no SGLang needed)."""

from __future__ import annotations

from typing import Any

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.core.spans import NUM_TOKENS_KEY, decode
from sgl_pic.http.request_translator import RequestTranslator
from sgl_pic.layout import LayoutError

BOS = 1000


class CharTokenizer:
    """One id per character, BOS on the first piece only; pad and EOS ids as given."""

    def __init__(self, pad_token_id: int | None = 7, eos_token_id: int | None = 8) -> None:
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([BOS] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages: list[dict], **_kw: object) -> str:
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def translator(page_size: int, tokenizer: CharTokenizer | None = None) -> RequestTranslator:
    tok = tokenizer or CharTokenizer()
    config = PicConfig(delimiter="<d>", page_size=page_size, min_chunk_tokens=1)
    return RequestTranslator(config, lambda: tok)


def chunk_texts(ids: list[int], custom: dict[str, Any], page_size: int) -> list[str]:
    pic = decode(custom, PicConfig(min_chunk_tokens=1))
    assert custom[NUM_TOKENS_KEY] == len(ids) == pic.layout.num_tokens
    assert all(s.start % page_size == 0 for s in pic.layout.chunks)
    return ["".join(chr(t) for t in ids[s.start : s.end]) for s in pic.layout.chunks]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_delimited_text_chunks_start_on_pages(page_size: int) -> None:
    out = translator(page_size).generate({"text": "ab<d>cde<d><d>f<d>gh"})
    assert out is not None and "text" not in out
    ids = out["input_ids"]
    assert chunk_texts(ids, out["sampling_params"]["custom_params"], page_size) == ["cde", "f"]
    # Everything but the pads is the unpadded prompt, in order.
    assert [t for t in ids if t != 7] == [BOS, *map(ord, "abcdefgh")]
    if page_size == 1:
        assert 7 not in ids


def test_explicit_spans_are_padded_with_their_input_ids() -> None:
    out = translator(4).generate(
        {"input_ids": [5, 6, 97, 98, 99, 100], "pic": {"chunks": [[2, 4], [4, 5]]}}
    )
    assert out is not None
    assert out["input_ids"] == [5, 6, 7, 7, 97, 98, 7, 7, 99, 100]
    pic = decode(out["sampling_params"]["custom_params"], PicConfig(min_chunk_tokens=1))
    assert [(s.start, s.end) for s in pic.layout.chunks] == [(4, 6), (8, 9)]


def test_chat_chunks_start_on_pages() -> None:
    req = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "doc one", "pic_chunk": True},
            {"role": "user", "content": "Q?"},
        ]
    }
    out = translator(8).chat(req)
    assert out is not None
    ids = out["input_ids"]
    assert chunk_texts(ids, out["custom_params"], 8) == ["doc one"]
    assert "".join(chr(t) for t in ids if t != 7) == "[system]S[user]doc one[user]Q?[assistant]"


def test_eos_pads_when_there_is_no_pad_token() -> None:
    out = translator(4, CharTokenizer(pad_token_id=None, eos_token_id=8)).generate(
        {"input_ids": [5, 6, 9], "pic": {"chunks": [[2, 3]]}}
    )
    assert out is not None
    assert out["input_ids"] == [5, 6, 8, 8, 9]


def test_no_pad_or_eos_token_is_a_layout_error() -> None:
    t = translator(4, CharTokenizer(pad_token_id=None, eos_token_id=None))
    with pytest.raises(LayoutError, match="neither a pad_token_id nor an eos_token_id"):
        t.generate({"input_ids": [5, 6, 9], "pic": {"chunks": [[2, 3]]}})
    # A page size of 1 needs no pad token.
    t1 = translator(1, CharTokenizer(pad_token_id=None, eos_token_id=None))
    assert t1.generate({"input_ids": [5, 6, 9], "pic": {"chunks": [[2, 3]]}}) is not None
