"""Chunk marks parsing and the request rewrite, without a server (no SGLang needed)."""

from __future__ import annotations

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.integration.http_ext import RequestTranslator
from sgl_pic.integration.spans import (
    MAC_KEY,
    MarkSigner,
    SpecialTokens,
    decode,
    split_on_delimiter,
)
from sgl_pic.layout import LayoutError

BOS = 1000
LOOSE = PicConfig(delimiter="<d>", min_chunk_tokens=1)


def fake_tokenize(text: str) -> list[int]:
    # One id per character; the BOS marker comes from SpecialTokens.
    return [ord(c) for c in text]


class FakeTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([BOS] if add_special_tokens else []) + fake_tokenize(text)}

    def apply_chat_template(self, messages: list[dict], **_kw: object) -> str:
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def translator(config: PicConfig = LOOSE, vocab_size: int | None = None) -> RequestTranslator:
    return RequestTranslator(config, FakeTokenizer, MarkSigner("k"), vocab_size)


def test_delimited_text_gives_token_exact_spans() -> None:
    specials = SpecialTokens((BOS,), ())
    ids, layout = split_on_delimiter("ab<d>cd<d>e<d>f<d>g", "<d>", fake_tokenize, specials)
    assert ids == [BOS, 97, 98, 99, 100, 101, 102, 103]
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
    custom = out["sampling_params"]["custom_params"]
    pic = decode(custom, LOOSE)
    assert [(s.start, s.end) for s in pic.layout.chunks] == [(0, 2), (2, 3)]
    assert pic.config(PicConfig()).policy == "epic"
    assert pic.config(PicConfig()).epic_k == 1
    assert MarkSigner("k").verify([5, 6, 7, 8], custom)
    # The namespace is the scheduler's to set, from the verified config.
    assert "extra_key" not in out


def test_marks_are_signed_over_their_tokens() -> None:
    out = translator().generate({"text": "a<d>bc<d>d"})
    assert out is not None
    custom, ids = out["sampling_params"]["custom_params"], out["input_ids"]
    assert MarkSigner("k").verify(ids, custom)
    assert not MarkSigner("other").verify(ids, custom)
    assert not MarkSigner("k").verify([*ids[:-1], ids[-1] + 1], custom)
    assert not MarkSigner("k").verify(ids, {**custom, "sgl_pic_chunks": [0, 1]})
    assert not MarkSigner("k").verify(ids, {k: v for k, v in custom.items() if k != MAC_KEY})


def test_a_prompt_starting_with_a_chunk_keeps_its_bos() -> None:
    out = translator().generate({"text": "<d>doc<d>question"})
    assert out is not None
    assert out["input_ids"][0] == BOS
    pic = decode(out["sampling_params"]["custom_params"], LOOSE)
    s = pic.layout.chunks[0]
    assert "".join(map(chr, out["input_ids"][s.start : s.end])) == "doc"


def test_plain_requests_are_untouched() -> None:
    assert translator().generate({"text": "no marks here"}) is None


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
        ({"input_ids": [1, 2, 3], "pic": {"chunks": [[True, 2]]}}, "pair of integers"),
        ({"text": "a<d>b<d>", "pic": {"config": {"epic_k": True}}}, "epic_k"),
        ({"text": "a<d>b<d>", "pic": {"config": {"daric_n_avg": 0}}}, "daric_n_avg"),
        ({"text": "a<d>b<d>", "pic": {"config": {"page_size": 4}}}, "cannot be overridden"),
        ({"text": ["a<d>b<d>", "c"]}, "batch of texts"),
        ({"input_ids": [1, True]}, r"'input_ids'\[1\] must be an integer"),
        ({"input_ids": [1, -2]}, r"'input_ids'\[1\] = -2 is outside"),
        ({"input_ids": [[1], [2, 500]]}, r"'input_ids\[1\]'\[1\] = 500 is outside"),
    ],
)
def test_malformed_marks_raise_layout_error(req: dict, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        translator(vocab_size=200).generate(req)


def test_limits_apply_at_the_edge() -> None:
    few = PicConfig(delimiter="<d>", max_chunks=2, min_chunk_tokens=2)
    assert translator(few).generate({"text": "<d>ab<d><d>cd<d>q"}) is not None
    with pytest.raises(LayoutError, match="at most 2"):
        translator(few).generate({"text": "<d>ab<d><d>cd<d><d>ef<d>"})
    with pytest.raises(LayoutError, match="at least 2"):
        translator(few).generate({"text": "<d>a<d>q"})


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"sampling_params": {"custom_params": {"sgl_pic_chunks": [0, 1]}}}, "internal"),
        ({"custom_params": {"sgl_pic_config": {}}}, "internal"),
        ({"extra_key": "sgl_pic:exact|"}, "internal"),
        ({"extra_key": ["x", "sgl_pic"]}, "internal"),
        ([{"custom_params": {"sgl_pic_mac": "00"}}], "internal"),
        ({"messages": [{"role": "user", "content": "x", "pic_chunk": "yes"}]}, "true or false"),
        ({"a": [[[[[[1]]]]]]}, "nested deeper"),
    ],
)
def test_client_bodies_with_internal_keys_or_deep_nesting_are_refused(
    body: object, needle: str
) -> None:
    from sgl_pic.integration.http_ext import check_client_body

    with pytest.raises(LayoutError, match=needle):
        check_client_body(body, max_depth=6)
    check_client_body({"custom_params": {"mine": 1}, "extra_key": "user"}, max_depth=6)


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
    pic = decode(out["custom_params"], LOOSE)
    assert [text[s.start : s.end] for s in pic.layout.chunks] == ["doc one", "doc two"]
    assert pic.overrides == {"policy": "full_reuse"}
    assert all("pic_chunk" not in m for m in out["messages"])
    assert "pic_chunk" not in out["messages"][2]["content"][0]


def test_chat_without_marks_is_untouched() -> None:
    assert translator().chat({"messages": [{"role": "user", "content": "hi"}]}) is None
