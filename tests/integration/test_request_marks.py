"""Chunk marks parsing and the request rewrite, without a server (no SGLang needed)."""

from __future__ import annotations

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.integration.http_ext import RequestTranslator
from sgl_pic.integration.spans import decode, split_on_delimiter
from sgl_pic.layout import LayoutError


def fake_tokenize(text: str, is_first: bool) -> list[int]:
    # One id per character, 1000 + a BOS marker on the first piece only.
    return ([1000] if is_first else []) + [ord(c) for c in text]


class FakeTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": fake_tokenize(text, add_special_tokens)}

    def apply_chat_template(self, messages: list[dict], **_kw: object) -> str:
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def translator() -> RequestTranslator:
    return RequestTranslator(PicConfig(delimiter="<d>"), FakeTokenizer)


def test_delimited_text_gives_token_exact_spans() -> None:
    ids, layout = split_on_delimiter("ab<d>cd<d>e<d>f<d>g", "<d>", fake_tokenize)
    assert ids == [1000, 97, 98, 99, 100, 101, 102, 103]
    assert [(s.start, s.end) for s in layout.chunks] == [(3, 5), (6, 7)]


def test_chunk_tokens_do_not_depend_on_neighbours() -> None:
    a, la = split_on_delimiter("x<d>chunk<d>y", "<d>", fake_tokenize)
    b, lb = split_on_delimiter("other text<d>chunk<d>", "<d>", fake_tokenize)
    sa, sb = la.chunks[0], lb.chunks[0]
    assert a[sa.start : sa.end] == b[sb.start : sb.end]


def test_rewrite_carries_marks_to_the_scheduler() -> None:
    req = {
        "input_ids": [5, 6, 7, 8],
        "pic": {"chunks": [[0, 2], [2, 3]], "config": {"policy": "epic", "epic_k": 1}},
        "sampling_params": {"max_new_tokens": 3},
    }
    out = translator().generate(req)
    assert out is not None and "pic" not in out
    assert out["sampling_params"]["max_new_tokens"] == 3
    pic = decode(out["sampling_params"]["custom_params"])
    assert pic is not None
    assert [(s.start, s.end) for s in pic.layout.chunks] == [(0, 2), (2, 3)]
    assert pic.config(PicConfig()).policy == "epic"
    assert pic.config(PicConfig()).epic_k == 1
    assert out["extra_key"] == "sgl_pic:"  # own prefix-tree namespace


def test_plain_requests_are_untouched() -> None:
    assert translator().generate({"text": "no marks here"}) is None
    assert decode({"other": 1}) is None


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        ({"input_ids": [1, 2], "pic": {"chunks": [[0, 3]]}}, "out of range"),
        ({"input_ids": [1, 2], "pic": {"chunks": "0-1"}}, "must be a list of"),
        ({"input_ids": [1, 2], "pic": {"chunks": [[0, 1]], "x": 1}}, "unknown field"),
        ({"text": "a", "pic": {"chunks": [[0, 1]]}}, "input_ids"),
        ({"text": "a<d>b"}, "unbalanced"),
        ({"text": "a", "pic": {"config": {"daric_r": 2.0}}}, "daric_r"),
        ({"text": "a", "pic": []}, "must be an object"),
    ],
)
def test_malformed_marks_raise_layout_error(req: dict, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        translator().generate(req)


def test_chat_marks_become_chunks_of_the_templated_prompt() -> None:
    req = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "doc one", "pic_chunk": True},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "doc two", "pic_chunk": True},
                    {"type": "text", "text": "Q?"},
                ],
            },
        ],
        "pic": {"config": {"policy": "full_reuse"}},
    }
    out = translator().chat(req)
    assert out is not None
    text = "".join(chr(t) for t in out["input_ids"])
    assert text == "[system]S[user]doc one[user]doc twoQ?[assistant]"
    pic = decode(out["custom_params"])
    assert pic is not None
    assert [text[s.start : s.end] for s in pic.layout.chunks] == ["doc one", "doc two"]
    assert pic.overrides == {"policy": "full_reuse"}
    assert all("pic_chunk" not in m for m in out["messages"])
    assert "pic_chunk" not in out["messages"][2]["content"][0]


def test_chat_without_marks_is_untouched() -> None:
    assert translator().chat({"messages": [{"role": "user", "content": "hi"}]}) is None
