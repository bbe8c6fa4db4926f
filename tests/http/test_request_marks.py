"""Chunk marks parsing and the request rewrite, without a server (no SGLang needed)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.core.spans import (
    MAC_KEY,
    MarkSigner,
    SpecialTokens,
    decode,
    split_on_delimiter,
)
from sgl_pic.http.middleware import PicHTTPMiddleware
from sgl_pic.http.request_translator import RequestTranslator
from sgl_pic.http.routes import CHAT_PATH as CHAT
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


def test_too_many_delimited_chunks_are_refused_before_any_is_tokenized() -> None:
    # Tokenizing piece by piece runs in the server's event loop: a body of a million
    # delimiters must be refused by counting them.
    seen: list[str] = []
    t = translator(PicConfig(delimiter="<d>", max_chunks=2, min_chunk_tokens=1))
    t._tokenize = lambda text, _special: seen.append(text) or fake_tokenize(text)
    with pytest.raises(LayoutError, match="3 chunks marked; .* at most 2"):
        t.generate({"text": "<d>a<d>" * 3 + "q"})
    assert seen == []


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
    from sgl_pic.http.body_checks import check_client_body

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
    assert text == "[system]S[user]doc one[user]doc two Q?[assistant]"  # items: " ".join
    pic = decode(out["custom_params"], LOOSE)
    assert [text[s.start : s.end] for s in pic.layout.chunks] == ["doc one", "doc two"]
    assert pic.overrides == {"policy": "full_reuse"}
    assert all("pic_chunk" not in m for m in out["messages"])
    assert "pic_chunk" not in out["messages"][2]["content"][0]


def test_chat_without_marks_is_untouched() -> None:
    assert translator().chat({"messages": [{"role": "user", "content": "hi"}]}) is None


def auto_translator(*roles: str) -> RequestTranslator:
    """Auto-chunking these roles, as with --pic-auto-chunk."""
    return RequestTranslator(LOOSE, FakeTokenizer, MarkSigner("k"), auto_chunk=frozenset(roles))


def post(
    path: str, body: str | dict | bytes, t: RequestTranslator | None = None
) -> tuple[int, str]:
    """``body`` through the middleware (no server): (400, its message) when refused, else
    (200, the body SGLang would get)."""
    if isinstance(body, bytes):
        raw = body
    else:
        raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    passed: list[bytes] = []
    sent: list[dict] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        passed.append((await receive())["body"])

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(PicHTTPMiddleware(app, t or translator())(scope, receive, send))
    if sent:
        return sent[0]["status"], json.loads(sent[1]["body"])["error"]["message"]
    return 200, passed[0].decode()


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_a_body_sglang_would_parse_is_checked_whatever_its_encoding(encoding: str) -> None:
    # SGLang reads a body with json.loads of its bytes, which takes a byte-order mark and
    # UTF-16/32: such a body must meet the same checks as plain UTF-8.
    refused = [
        '{"text": "x", "sampling_params": {"custom_params": {"sgl_pic_mac": "0"}}}',
        '{"text": "plain \\uDBFF"}',
        '{"text": "x", "rid": ["a", "b"]}',
    ]
    for raw in refused:
        status, _ = post("/generate", raw.encode(encoding))
        assert status == 400, (encoding, raw)
    status, body = post("/generate", '{"text": "a <d>doc<d> q"}'.encode(encoding))
    assert status == 200 and "sgl_pic" in body  # its delimiters became marks


def test_lone_surrogates_get_a_400_naming_where_they_stand() -> None:
    doc = '"content": "\\ud800 doc", "pic_chunk": true'
    cases = [
        (CHAT, '{"messages": [{"role": "user", ' + doc + '}, {"role": "user", "content": "q"}]}'),
        (
            CHAT,
            '{"pic": {"auto_chunk": true}, "messages": [{"role": "tool", "content": "\\udfff"}]}',
        ),
        (
            CHAT,
            '{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "description": "\\udfff x"}}]}',
        ),
        ("/generate", '{"text": "a <d>\\ud800 doc<d> q", "sampling_params": {}}'),
        ("/generate", '{"text": "plain \\uDBFF"}'),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}'),
    ]
    for path, raw in cases:
        status, message = post(path, raw, auto_translator("tool"))
        assert status == 400 and "lone UTF-16 surrogate" in message, (raw, message)
    assert "'messages[0].content'" in post(*cases[0])[1]
    assert "'tools[0].function.description'" in post(*cases[2])[1]
    # A pair is one character, served as usual; other paths are SGLang's.
    status, body = post("/generate", '{"text": "a <d>\\ud83d\\ude00 doc<d> q"}')
    assert status == 200 and "input_ids" in json.loads(body)
    assert post("/tokenize", '{"prompt": "\\ud800"}')[0] == 200
    # The translator checks what it tokenizes too, whoever calls it.
    with pytest.raises(LayoutError, match="lone UTF-16 surrogate"):
        translator().generate({"text": "a<d>\ud800b<d>q"})


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        (
            "/generate",
            {"text": "a", "sampling_params": {"stop_regex": "(("}},
            "not a valid regular",
        ),
        ("/generate", {"text": ["a"], "sampling_params": [{"stop_regex": ["x", "[z"]}]}, r"\[0\]"),
        ("/generate", {"text": "a", "sampling_params": {"stop_regex": [5]}}, "must be a regular"),
        ("/v1/completions", {"prompt": "a", "stop_regex": "(("}, "'stop_regex' = '\\(\\(' is not"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "stop_regex": "a{2,1}"}, "valid"),
        ("/generate", {"text": "a", "rid": ["x"]}, "single request must be a string"),
        ("/generate", {"input_ids": [5, 6], "rid": ["x"]}, "single request must be a string"),
        ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "lists 1 ids for 2 prompt"),
        ("/generate", {"text": "a", "rid": 5}, "string or a list of strings"),
        ("/generate", {"text": ["a", "b"], "rid": ["x", 5]}, r"'rid'\[1\] must be a string"),
        ("/generate", {"text": "a", "sampling_params": {"n": 2}, "rid": ["x", "y"]}, "lists 2"),
        ("/v1/completions", {"prompt": [5, 6], "rid": ["x"]}, "single request must be a string"),
        ("/v1/completions", {"prompt": "a", "pic": {}}, "not supported on /v1/completions"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "rid": ["x"]}, "single request"),
        ("/generate", {"text": "a<d>b<d>", "input_ids": [5, 6]}, "not both"),
        ("/generate", {"text": "a", "input_ids": [5, 6], "pic": {}}, "not both"),
    ],
)
def test_bad_stop_regex_rid_and_ambiguous_prompts_get_a_400(
    path: str, body: dict, needle: str
) -> None:
    status, message = post(path, body)
    assert status == 400 and re.search(needle, message), message


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "a", "sampling_params": {"stop_regex": r"\d+\.$"}, "rid": "x"}),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"stop_regex": ["x", "y|z"]}}),
        ("/generate", {"text": ["a", "b"], "rid": ["x", "y"]}),
        ("/generate", {"text": ["a", "b"], "rid": "x"}),
        ("/generate", {"input_ids": [[5], [6]], "rid": ["x", "y"]}),
        ("/generate", {"text": "a", "sampling_params": {"n": 2}, "rid": ["x"]}),
        ("/generate", {"text": "a<d>b<d>", "sampling_params": {"stop_regex": "b"}, "rid": "x"}),
        ("/v1/completions", {"prompt": ["a", "b"], "rid": ["x", "y"], "stop_regex": "a"}),
        ("/v1/completions", {"prompt": "a", "n": 2, "rid": ["x"]}),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "n": 2, "rid": ["x"]}),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "stop_regex": ["a$"], "rid": "x"}),
    ],
)
def test_valid_stop_regex_and_rid_pass(path: str, body: dict) -> None:
    status, passed = post(path, body)
    assert status == 200, passed
    assert json.loads(passed).get("rid") == body.get("rid")


def test_template_options_are_applied_with_chunk_marks() -> None:
    msgs = [
        {"role": "user", "content": "doc", "pic_chunk": True},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A: "},
    ]
    for option, value in [
        ("continue_final_message", True),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("reasoning_effort", "low"),
        ("reasoning", {"effort": "low"}),
        ("thinking", {"type": "enabled"}),
    ]:
        out = translator().chat({"messages": msgs, option: value})
        assert out is not None and out["custom_params"], option
    # Without continue_final_message the final assistant message is a user turn; with it,
    # its text is appended to the rendering (the fake template ends with "[assistant]").
    out = translator().chat({"messages": msgs})
    assert "".join(chr(t) for t in out["input_ids"]) == "[user]doc[user]Q?[user]A: [assistant]"
    out = translator().chat({"messages": msgs, "continue_final_message": True})
    text = "".join(chr(t) for t in out["input_ids"])  # the text encoded as SGLang encodes it
    assert text.startswith("[user]doc[user]Q?[assistant]") and text.endswith("A: ")
    # A client's input_ids replace the template's prompt the marks are found in.
    with pytest.raises(LayoutError, match="'input_ids' cannot be combined with chunk"):
        translator().chat({"messages": msgs, "input_ids": [5, 6]})
    auto = [{k: v for k, v in m.items() if k != "pic_chunk"} for m in msgs]
    t = auto_translator("user", "assistant")
    assert t.chat({"messages": auto, "input_ids": [5, 6]}) is None
    out = t.chat({"messages": auto, "input_ids": [5, 6], "pic": {"auto_chunk": True}})
    assert out is not None and "pic" not in out and out["input_ids"] == [5, 6]


def test_a_final_assistant_message_renders_as_sglang_renders_it() -> None:
    """SGLang's chat path without continue_final_message makes a final assistant message a
    user turn of its text alone (tool calls dropped)."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "doc", "pic_chunk": True},
        {"role": "assistant", "content": "A", "tool_calls": [call]},
    ]
    out = translator().chat({"messages": msgs})
    assert out is not None
    assert "".join(chr(t) for t in out["input_ids"]) == "[user]doc[user]A[assistant]"
    # A tool call SGLang's request model refuses is refused here too.
    bad = [msgs[0], {**msgs[1], "tool_calls": [{"id": "c", "type": "function"}]}]
    with pytest.raises(LayoutError, match="invalid chat request"):
        translator().chat({"messages": bad})
