"""Chat requests turned into chunks: auto-chunking of tool results, documents and earlier
turns, tool schemas as chunks of the template's own rendering, template options, long
messages in windows (the embedded model's real tokenizer, no server); and one agent
session through a server with ``--pic-auto-chunk``."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.config import PicConfig
from sgl_pic.core.spans import MarkSigner, decode
from sgl_pic.http.chat_chunks import parse_roles, search_renders, windows
from sgl_pic.http.chat_render import ChatTemplate
from sgl_pic.http.cut_points import cut_points
from sgl_pic.http.middleware import RequestTranslator
from sgl_pic.layout import LayoutError, PromptLayout, Span
from tests.support.chat_templates import templated
from tests.support.prompts import DOCS, ids, tokenizer
from tests.support.server import Server, launch
from tests.support.session_checks import (
    CONTIG,
    DISJOINT,
    MISSES,
    PREFIX,
    offline_recompute,
)
from tests.support.session_checks import SESSION_KEYS as KEYS

ALL = frozenset({"tool", "document", "user", "assistant"})
# The texts here are a sentence each, under the default auto_chunk_min_tokens: tests of
# which messages become chunks lower it.
SHORT = PicConfig(auto_chunk_min_tokens=4)
SYSTEM = "You are a travel agent. Answer in one short sentence."
U1 = "Which city lies almost exactly on the equator?"
A1 = "Let me look that up in the travel guide for you."
U2 = "And which city is a port famous for its funiculars?"


def tool(name: str, description: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in props.items()},
                "required": sorted(props),
            },
        },
    }


SEARCH = tool("search", "Search the travel guide.", query="string")
WEATHER = tool("weather", "Today's weather in a city.", city="string")
BOOK = tool("book", "Book a hotel room.", city="string", date="string")


def session() -> list[dict[str, Any]]:
    """System prompt, a document, a finished turn with a tool result, the question, and a
    tool result after it."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "name": "document", "content": DOCS["A"]},
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1},
        {"role": "tool", "tool_call_id": "c1", "content": DOCS["C"]},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "search", "port")]},
        {"role": "tool", "tool_call_id": "c2", "content": DOCS["E"]},
    ]


def call(call_id: str, name: str, query: str) -> dict[str, Any]:
    args = json.dumps({"query": query})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def translator(
    auto: frozenset[str] = frozenset(), config: PicConfig | None = None, template: str = ""
) -> RequestTranslator:
    """A translator on the embedded model's tokenizer, with its own chat template or the
    fixture ``template`` (tests/support/templates)."""
    tok = templated(template) if template else tokenizer()
    return RequestTranslator(config or SHORT, lambda: tok, MarkSigner("k"), auto_chunk=auto)


def sglang_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as SGLang hands them to the template (its request model's dump)."""
    from sglang.srt.entrypoints.openai.protocol import Tool

    return [Tool(**t).model_dump() for t in tools]


def chunk_ids(out: dict[str, Any], config: PicConfig | None = None) -> list[list[int]]:
    """Token ids of each chunk of a rewritten chat request."""
    layout = decode(out["custom_params"], config or PicConfig()).layout
    return [out["input_ids"][s.start : s.end] for s in layout.chunks]


def chunk_texts(out: dict[str, Any], config: PicConfig | None = None) -> list[str]:
    return [tokenizer().decode(c) for c in chunk_ids(out, config)]


def chat(t: RequestTranslator, body: dict[str, Any]) -> dict[str, Any] | None:
    return t.chat(copy.deepcopy(body))


# -- auto-chunking ---------------------------------------------------------------------


def test_without_marks_or_auto_chunking_chat_passes_on_unchanged() -> None:
    body = {"messages": session(), "tools": [SEARCH]}
    assert chat(translator(), body) is None


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        # Earlier turns stop at the last user message (U2, the question): A1 is one, the
        # tool call after U2 is not; tool results and documents count wherever they stand.
        (ALL, [DOCS["A"], U1, A1, DOCS["C"], DOCS["E"]]),
        (frozenset({"tool"}), [DOCS["C"], DOCS["E"]]),
        (frozenset({"document"}), [DOCS["A"]]),
        (frozenset({"user", "assistant"}), [DOCS["A"], U1, A1]),
        (frozenset({"system"}), [SYSTEM]),
    ],
)
def test_auto_chunking_marks_tool_results_documents_and_earlier_turns(
    roles: frozenset[str], expected: list[str]
) -> None:
    out = chat(translator(roles), {"model": "m", "messages": session()})
    assert out is not None
    assert chunk_texts(out) == expected
    # Each chunk is its message's text tokenized on its own.
    assert chunk_ids(out) == [ids(t) for t in expected]
    assert "pic" not in out and out["model"] == "m"


def test_documents_are_messages_named_document_in_any_role() -> None:
    msgs = [
        {"role": "system", "name": "document", "content": DOCS["B"]},
        {"role": "user", "content": U1},
        {"role": "system", "name": "document", "content": DOCS["D"]},  # after the question
        {"role": "user", "name": "notes", "content": DOCS["A"]},  # another name: not one
    ]
    out = chat(translator(frozenset({"document"})), {"messages": msgs})
    assert out is not None
    assert chunk_texts(out) == [DOCS["B"], DOCS["D"]]


def test_the_question_is_fresh_and_becomes_a_chunk_once_answered() -> None:
    tools = [SEARCH, WEATHER]
    # Leading spaces: tokenized after the template's newline, they give other tokens than
    # on their own, so only tokenizing every message text alone keeps the prefix.
    question = "  " + U1
    assert ids("user\n" + question) != ids("user\n") + ids(question)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    turn2 = [*turn1, {"role": "assistant", "content": A1}, {"role": "user", "content": U2}]
    out1 = chat(translator(ALL, template="qwen25"), {"messages": turn1, "tools": tools})
    out2 = chat(translator(ALL, template="qwen25"), {"messages": turn2, "tools": tools})
    assert out1 is not None and out2 is not None
    assert question not in chunk_texts(out1)
    assert question in chunk_texts(out2) and A1 in chunk_texts(out2)
    # Every message text is tokenized on its own either way, so turn 1's prompt is a prefix
    # of turn 2's: SGLang's prefix cache serves it as device prefix.
    n = len(out1["input_ids"])
    assert out2["input_ids"][:n] == out1["input_ids"]
    layout2 = decode(out2["custom_params"], PicConfig()).layout
    u1 = next(s for s in layout2.chunks if out2["input_ids"][s.start : s.end] == ids(question))
    assert u1.end <= n  # the new chunk lies inside the previous turn's tokens


def test_short_texts_stay_fresh() -> None:
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1},
        {"role": "tool", "content": LONG},
        {"role": "user", "content": U2},
    ]
    assert len(ids("Hi")) < 4 and len(ids("Hello!")) < 4
    assert SHORT.min_chunk_tokens == SHORT.auto_chunk_min_tokens == 4
    out = chat(translator(ALL, SHORT), {"messages": msgs})
    assert out is not None
    assert chunk_texts(out)[:2] == [U1, A1]
    # By default a sentence stays fresh too (reuse would recompute most of it); a long
    # text is still a chunk.
    config = PicConfig()
    assert len(ids(U1)) < config.auto_chunk_min_tokens <= len(ids(LONG))
    out = chat(translator(ALL, config), {"messages": msgs})
    assert out is not None
    assert "".join(chunk_texts(out, config)) == LONG
    # A client's mark is honoured down to min_chunk_tokens.
    marked = [{**m, "pic_chunk": True} if m["content"] == A1 else m for m in msgs]
    out = chat(translator(frozenset(), config), {"messages": marked})
    assert out is not None and chunk_texts(out, config) == [A1]


def test_past_max_chunks_the_earliest_auto_chunks_stay_fresh() -> None:
    msgs = [{"role": "tool", "content": DOCS[k]} for k in "ABCDE"]
    msgs.insert(2, {"role": "user", "content": DOCS["B"] + " (mine)", "pic_chunk": True})
    config = PicConfig(max_chunks=3, auto_chunk_min_tokens=4)
    out = chat(translator(ALL, config), {"messages": msgs})
    assert out is not None
    # The marked chunk stays; of the five tool results, the three earliest are left fresh.
    assert chunk_texts(out, config) == [DOCS["B"] + " (mine)", DOCS["D"], DOCS["E"]]


def test_more_client_marks_than_max_chunks_are_refused_before_rendering() -> None:
    # Rendering and tokenizing piece by piece run in the server's event loop.
    t = translator(ALL, PicConfig(max_chunks=2, auto_chunk_min_tokens=4))
    rendered: list[Any] = []

    class Recording(ChatTemplate):
        def render(self, inputs: Any) -> Any:
            rendered.append(inputs)
            return super().render(inputs)

    t._render_chat = lambda: Recording(tokenizer())  # type: ignore[method-assign]
    msgs = [{"role": "user", "content": DOCS[k], "pic_chunk": True} for k in "AB"]
    msgs.append({"role": "user", "content": [{"type": "text", "text": "q", "pic_chunk": True}]})
    with pytest.raises(LayoutError, match="3 chunks marked; .* at most 2"):
        chat(t, {"messages": msgs})
    assert rendered == []


def test_explicit_marks_still_work_and_win() -> None:
    msgs = session()
    msgs[2]["pic_chunk"] = False  # kept out of auto-chunking
    msgs[5] = {  # the question, with a marked text item
        "role": "user",
        "content": [
            {"type": "text", "text": DOCS["D"], "pic_chunk": True},
            {"type": "text", "text": U2},
        ],
    }
    out = chat(translator(ALL), {"messages": msgs})
    assert out is not None
    assert chunk_texts(out) == [DOCS["A"], A1, DOCS["C"], DOCS["D"], DOCS["E"]]
    assert all("pic_chunk" not in m for m in out["messages"])
    assert "pic_chunk" not in out["messages"][5]["content"][0]
    # Without auto-chunking, only the client's marks are chunks.
    out = chat(translator(), {"messages": msgs})
    assert out is not None
    assert chunk_texts(out) == [DOCS["D"]]


@pytest.mark.parametrize(
    ("server", "option", "expected"),
    [
        (frozenset({"tool"}), False, None),
        (frozenset(), True, [DOCS["A"], U1, A1, DOCS["C"], DOCS["E"]]),  # the default roles
        (frozenset({"tool", "user"}), True, [DOCS["A"], U1, DOCS["C"], DOCS["E"]]),
        (frozenset({"tool"}), ["user"], [DOCS["A"], U1]),
        (frozenset({"tool"}), [], None),
    ],
)
def test_the_request_option_overrides_the_server_flag(
    server: frozenset[str], option: Any, expected: list[str] | None
) -> None:
    out = chat(translator(server), {"messages": session(), "pic": {"auto_chunk": option}})
    assert out is not None and "pic" not in out
    if expected is None:
        assert "input_ids" not in out and "custom_params" not in out  # SGLang renders it
    else:
        assert chunk_texts(out) == expected


def test_the_request_option_carries_overrides() -> None:
    body = {"messages": session(), "pic": {"auto_chunk": ["tool"], "config": {"policy": "epic"}}}
    out = chat(translator(), body)
    assert out is not None
    assert decode(out["custom_params"], PicConfig()).overrides == {"policy": "epic"}
    # Overrides without any chunk are an error, unless auto-chunking was asked about.
    with pytest.raises(LayoutError, match="needs at least one message marked"):
        chat(translator(), {"messages": [{"role": "user", "content": U1}], "pic": {}})
    plain = {"messages": [{"role": "user", "content": U1}], "pic": {"auto_chunk": True}}
    assert chat(translator(), plain) == {"messages": plain["messages"]}


def test_template_options_are_rendered_and_chunked() -> None:
    """Qwen3's enable_thinking, reasoning_effort: applied by the template as SGLang applies
    them, and the request is still chunked (it was left to SGLang unchunked)."""
    t = translator(ALL, template="qwen3")
    for options in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"reasoning_effort": "low"},
    ):
        body = {"messages": session(), "tools": [SEARCH, WEATHER], **options}
        out = chat(t, body)
        assert out is not None, options
        assert chunk_texts(out)[2:4] == [DOCS["A"], U1]  # after the two tool schemas
        text = tokenizer().decode(out["input_ids"])
        assert text == sglang_render("qwen3", body), options
    thinking_off = chat(
        t, {"messages": session(), "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert thinking_off is not None
    assert tokenizer().decode(thinking_off["input_ids"]).endswith("<think>\n\n</think>\n\n")


def sglang_render(template: str, body: dict[str, Any]) -> str:
    """What SGLang's chat path renders for ``body`` with fixture ``template`` (its request
    model, message dump and template call, done here with SGLang's own helpers)."""
    from sgl_pic.http.chat_render import chat_inputs

    inputs = chat_inputs(body, "string", {})
    tok = templated(template) if template else tokenizer()
    text = tok.apply_chat_template(
        inputs.messages,
        tokenize=False,
        add_generation_prompt=inputs.add_generation_prompt,
        tools=inputs.tools,
        **inputs.kwargs,
    )
    return text + (inputs.prefix or "")


def test_auto_chunking_leaves_what_it_cannot_render_to_sglang() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    msgs = [{"role": "tool", "content": DOCS["A"]}, {"role": "user", "content": [image]}]
    assert chat(translator(ALL), {"messages": msgs}) is None
    marked = [{**msgs[0], "pic_chunk": True}, msgs[1]]
    with pytest.raises(LayoutError, match="only text items"):
        chat(translator(ALL), {"messages": marked})
    # The delimiter is text like any other in a chat message: the template renders it.
    d = PicConfig().delimiter
    msgs = [{"role": "tool", "content": DOCS["A"]}, {"role": "user", "content": f"a {d} b"}]
    out = chat(translator(ALL), {"messages": msgs})
    assert out is not None and chunk_texts(out) == [DOCS["A"]]
    assert tokenizer().decode(out["input_ids"]) == sglang_render("", {"messages": msgs})


def test_a_template_that_rewrites_text_leaves_it_fresh() -> None:
    msgs = [{"role": "tool", "content": DOCS["A"]}, {"role": "user", "content": U1}]

    tok = copy.copy(tokenizer())
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content[:-3] }}{% endfor %}"
    t = RequestTranslator(SHORT, lambda: tok, MarkSigner("k"), auto_chunk=ALL)
    assert chat(t, {"messages": msgs}) is None  # nothing verbatim: served as it is
    marked = [{**msgs[0], "pic_chunk": True}, msgs[1]]
    with pytest.raises(LayoutError, match="verbatim"):
        chat(t, {"messages": marked})
    # Only the piece the template rewrites stays fresh.
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'user' %}{{ m.content[:-3] }}{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}"
    )
    out = chat(t, {"messages": msgs})
    assert out is not None and chunk_texts(out) == [DOCS["A"]]


def counting(t: RequestTranslator, template: str) -> list[int]:
    """Counts the marked renderings ``t`` makes (each renders the whole conversation)."""
    calls: list[int] = []

    class Counting(ChatTemplate):
        def render_marked(self, *args: Any, **kwargs: Any) -> str:
            calls.append(1)
            return super().render_marked(*args, **kwargs)

    tok = templated(template)
    t._render_chat = lambda: Counting(tok)  # type: ignore[method-assign]
    return calls


def long_turns(n: int, text: str) -> list[dict[str, Any]]:
    msgs = []
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i}: {text}"})
        msgs.append({"role": "assistant", "content": f"answer {i}: {text}"})
    return [*msgs, {"role": "user", "content": "final?"}]


def test_a_piece_the_template_trims_costs_a_bounded_number_of_renderings() -> None:
    """A template that trims content (llama3), one message with a trailing newline: the
    pieces are not searched one by one (each try renders the whole conversation, in the
    server's event loop), only those that can become chunks, by bisection, within a bound
    set by max_chunks."""
    config = PicConfig()
    t = translator(ALL, config, template="llama3")
    calls = counting(t, "llama3")
    # Short turns (under auto_chunk_min_tokens): nothing to search for.
    msgs = long_turns(200, "short")
    msgs[1]["content"] += "\n"
    assert chat(t, {"messages": msgs}) is None
    assert len(calls) <= 2
    # Long turns, one trimmed: found by bisection, the others still chunks.
    calls.clear()
    long = f"{DOCS['A']} {DOCS['B']}"  # 37 tokens: over auto_chunk_min_tokens
    msgs = long_turns(100, long)
    msgs[7]["content"] += "\n"
    out = chat(t, {"messages": msgs})
    assert out is not None
    assert tokenizer().decode(out["input_ids"]) == sglang_render("llama3", {"messages": msgs})
    texts = chunk_texts(out, config)
    assert f"answer 3: {long}" not in texts and f"answer 4: {long}" in texts
    assert len(texts) == 199
    assert len(calls) <= 2 + 2 * 8
    # Every long turn trimmed: at most search_renders(config) renderings, all fresh.
    calls.clear()
    msgs = long_turns(100, long + "\n")
    assert chat(t, {"messages": msgs}) is None
    assert len(calls) <= 1 + search_renders(config)
    # Client marks the search does not reach within the bound are refused, saying so.
    config = PicConfig(max_chunks=64)
    t = translator(ALL, config, template="llama3")
    calls = counting(t, "llama3")
    msgs = long_turns(40, long)
    for m in msgs[40:80]:
        m["content"] += "\n"
    marked = [{**m, "pic_chunk": True} for m in msgs[:60]] + msgs[60:]
    with pytest.raises(LayoutError, match=f"took more than {search_renders(config)} renderings"):
        chat(t, {"messages": marked})
    assert len(calls) <= 1 + search_renders(config)
    # Marks the template renders verbatim still work next to trimmed auto pieces.
    msgs = long_turns(40, long + "\n")
    msgs[0] = {"role": "user", "content": long, "pic_chunk": True}
    out = chat(t, {"messages": msgs})
    assert out is not None and chunk_texts(out, config) == [long]


# -- tool schemas ----------------------------------------------------------------------


def tool_chunks(
    tools: list[dict[str, Any]], template: str = "qwen25", **body: Any
) -> dict[str, list[int]]:
    """Tool name -> its chunk's token ids, of a request carrying ``tools``."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U1}]
    t = translator(frozenset({"tool"}), template=template)
    out = chat(t, {"messages": msgs, "tools": tools, **body})
    assert out is not None
    assert tokenizer().decode(out["input_ids"]) == sglang_render(
        template, {"messages": msgs, "tools": tools, **body}
    )
    found = {}
    for c in chunk_ids(out):
        schema = json.loads(tokenizer().decode(c))
        found[schema.get("function", schema)["name"]] = c
    return found


@pytest.mark.parametrize("template", ["qwen25", "qwen3", "llama3", "mistral"])
def test_each_tool_schema_is_one_chunk_whatever_the_order_or_subset(template: str) -> None:
    full = tool_chunks([SEARCH, WEATHER, BOOK], template)
    assert sorted(full) == ["book", "search", "weather"]
    for subset in ([BOOK, SEARCH], [WEATHER], [WEATHER, BOOK, SEARCH]):
        got = tool_chunks(subset, template)
        assert got == {name: full[name] for name in got}
    # The same schema with its keys in another order is another text in the prompt (the
    # template serialises what it is given, and the prompt is the template's): another
    # chunk, still one of its own.
    shuffled = json.loads(json.dumps(WEATHER))
    shuffled["function"] = dict(reversed(list(shuffled["function"].items())))
    assert tool_chunks([shuffled], template)["weather"] != full["weather"]


def test_tools_are_where_the_template_puts_them_and_sglang_keeps_them() -> None:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U1}],
        "tools": [SEARCH],
    }
    out = chat(translator(frozenset({"tool"}), template="qwen25"), body)
    assert out is not None
    text = tokenizer().decode(out["input_ids"])
    assert text == sglang_render("qwen25", body)
    schema = json.dumps(sglang_tools([SEARCH])[0])
    assert f"<tools>\n{schema}\n</tools>" in text
    assert chunk_texts(out) == [schema]
    # SGLang keeps the tools (it parses tool calls with them) and renders no prompt.
    assert out["tools"] == [SEARCH]
    # A template without a tool section (the embedded model's) shows none: nothing to chunk.
    assert chat(translator(frozenset({"tool"})), body) is None


def test_tools_follow_tool_choice_and_any_chunk_mark() -> None:
    assert sorted(tool_chunks([SEARCH, WEATHER], tool_choice="auto")) == ["search", "weather"]
    named = {"type": "function", "function": {"name": "weather"}}
    assert sorted(tool_chunks([SEARCH, WEATHER], tool_choice=named)) == ["weather"]
    msgs = [{"role": "user", "content": U1}]
    out = chat(
        translator(frozenset({"tool"}), template="qwen25"),
        {"messages": msgs, "tools": [SEARCH], "tool_choice": "none"},
    )
    assert out is None  # nothing left to chunk
    # A client's mark makes tools chunks too, with auto-chunking off.
    marked = [{"role": "user", "content": DOCS["A"], "pic_chunk": True}, *msgs]
    out = chat(translator(template="qwen25"), {"messages": marked, "tools": [SEARCH, WEATHER]})
    assert out is not None
    assert len(chunk_texts(out)) == 3 and chunk_texts(out)[2] == DOCS["A"]


# -- long messages ---------------------------------------------------------------------

LONG = " ".join(DOCS[k] for k in "ABCDE" * 3)


def test_windows_are_the_cut_points_of_the_span_tokens() -> None:
    toks = ids(LONG)
    assert windows(Span(10, 74), toks[:64], 64, 4) == [Span(10, 74)]
    got = windows(Span(100, 100 + len(toks)), toks, 64, 4)
    assert [w.end - 100 for w in got] == cut_points(toks, 64, 4)
    assert got[0].start == 100 and len(got) > 2


def test_a_long_message_gives_the_same_window_chunks_wherever_it_appears() -> None:
    config = PicConfig(segment_tokens=64)
    n = len(ids(LONG))
    assert n > 3 * 64
    first = [{"role": "tool", "content": LONG}, {"role": "user", "content": U1}]
    later = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": A1},
        {"role": "tool", "content": DOCS["B"]},
        {"role": "tool", "content": LONG},
        {"role": "user", "content": U1},
    ]
    a = chat(translator(frozenset({"tool"}), config), {"messages": first})
    b = chat(translator(frozenset({"tool"}), config), {"messages": later})
    assert a is not None and b is not None
    # DOCS["B"], a sentence, stays fresh (under auto_chunk_min_tokens).
    wa, wb = chunk_ids(a, config), chunk_ids(b, config)
    assert wa == wb
    shortest = config.auto_chunk_min_tokens
    assert (
        all(shortest <= len(w) <= 64 for w in wa[:-1]) and shortest <= len(wa[-1]) < 64 + shortest
    )
    assert sum(wa, []) == ids(LONG)  # the message's own tokenization, cut in windows
    layout = decode(b["custom_params"], config).layout
    assert layout.chunks[0].start != decode(a["custom_params"], config).layout.chunks[0].start
    # A client's chunk is kept whole, however long.
    marked = [{"role": "user", "content": LONG, "pic_chunk": True}, first[1]]
    out = chat(translator(frozenset(), config), {"messages": marked})
    assert out is not None and chunk_ids(out, config) == [ids(LONG)]


def test_an_edited_long_message_keeps_its_windows_away_from_the_edit() -> None:
    config = PicConfig(segment_tokens=64)
    words = sorted(set(" ".join(DOCS.values()).split()))
    rng = random.Random(0)
    text = [rng.choice(words) for _ in range(700)]
    long_text = " ".join(text)
    edited = " ".join(text[:300] + ["One", "more", "sentence", "was", "added."] + text[300:])
    runs = []
    for body in (long_text, edited):
        msgs = [{"role": "tool", "content": body}, {"role": "user", "content": U1}]
        out = chat(translator(frozenset({"tool"}), config), {"messages": msgs})
        assert out is not None
        runs.append([tuple(w) for w in chunk_ids(out, config)])
    old, new = runs
    shared = set(old) & set(new)
    # Cut where the tokens say, the windows before the edit and all but a few after it
    # keep their cache keys; windows counted from the start would all shift past it.
    assert len(old) > 8 and len(shared) >= len(old) - 3
    assert old[-1] == new[-1]


def test_auto_chunks_start_on_pages() -> None:
    config = PicConfig(segment_tokens=64, page_size=16)
    out = chat(
        translator(frozenset({"tool"}), config),
        {"messages": [{"role": "user", "content": U1}, {"role": "tool", "content": LONG}]},
    )
    assert out is not None
    layout = decode(out["custom_params"], config).layout
    assert len(layout.chunks) > 2 and all(s.start % 16 == 0 for s in layout.chunks)


# -- malformed input -------------------------------------------------------------------


def _fn(**fn: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": fn}]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"pic": {"auto_chunk": "tool"}}, "must be true, false or a list of roles"),
        ({"pic": {"auto_chunk": 1}}, "must be true, false or a list of roles"),
        ({"pic": {"auto_chunk": None}}, "must be true, false or a list of roles"),
        ({"pic": {"auto_chunk": ["tool", "robot"]}}, r"'pic.auto_chunk'\[1\] = 'robot' is not"),
        ({"pic": {"auto_chunk": [["tool"]]}}, r"'pic.auto_chunk'\[0\]"),
        ({"pic": {"autochunk": True}}, r"unknown field\(s\) \['autochunk'\]"),
        ({"pic": "yes"}, "'pic' must be an object"),
        ({"pic": {"config": {"daric_r": 2.0}}}, "daric_r"),
        ({"tools": {"search": SEARCH}}, "'tools' must be a list"),
        ({"tools": ["search"]}, "tool 0 must be an object"),
        ({"tools": [{"type": "function"}]}, "tool 0: 'function' must be an object"),
        ({"tools": _fn(description="no name")}, r"'function.name' must be a string"),
        ({"tools": _fn(name=7)}, r"'function.name' must be a string"),
        ({"tools": _fn(name="a", description=3)}, "'function.description' must be a string"),
        ({"tools": [{"type": 1, "function": {"name": "a"}}]}, "'type' must be a string"),
        ({"tools": [SEARCH], "tool_choice": "sometimes"}, "'tool_choice' must be"),
        ({"messages": ["hi"]}, "message 0 must be an object"),
        ({"messages": [{"role": 3, "content": "x"}]}, "'role' must be a string"),
        ({"messages": [{"role": "user", "content": 5}]}, "'content' must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "'text' must be a string",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "pic_chunk": True,
                        "content": [{"type": "text", "text": U1, "pic_chunk": True}],
                    }
                ]
            },
            "mark either the message or its items",
        ),
        ({"messages": [{"role": "user", "content": "", "pic_chunk": True}]}, "empty"),
    ],
)
def test_malformed_chat_requests_raise_layout_error(body: dict[str, Any], needle: str) -> None:
    req = {"messages": session(), **body}
    with pytest.raises(LayoutError, match=needle):
        chat(translator(ALL), req)


@pytest.mark.parametrize(
    "tools",
    [
        _fn(name="f", description=None, parameters=None),
        _fn(name="f"),
        _fn(name="", description="unnamed"),
        _fn(name="a", parameters="{}"),
        _fn(name="a", parameters=[1]),
        [{"type": "retrieval", "function": {"name": "a"}}],
        [SEARCH, SEARCH],
        [SEARCH, {"type": "function", "function": {**SEARCH["function"], "description": None}}],
    ],
)
def test_tools_sglang_accepts_are_rendered_as_it_renders_them(tools: list[Any]) -> None:
    """Tools SGLang's request model accepts (null description or parameters, any schema,
    a name used twice) are no error: auto-chunked as the template shows them, and client
    marks on messages still work."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    msgs = [{"role": "user", "content": DOCS["A"]}, {"role": "user", "content": U1}]
    ChatCompletionRequest(model="m", messages=msgs, tools=tools)  # SGLang takes it
    for template in ("qwen25", ""):
        body = {"messages": msgs, "tools": tools}
        out = chat(translator(ALL, template=template), body)
        assert out is not None
        assert tokenizer().decode(out["input_ids"]) == sglang_render(template, body)
        assert DOCS["A"] in chunk_texts(out)
        if template:  # each tool, as the template serialises it, is a chunk
            assert len(chunk_texts(out)) == len(tools) + 1
        marked = [{**msgs[0], "pic_chunk": True}, msgs[1]]
        out = chat(translator(template=template), {"messages": marked, "tools": tools})
        assert out is not None and DOCS["A"] in chunk_texts(out)
        assert tokenizer().decode(out["input_ids"]) == sglang_render(template, body)


@pytest.mark.parametrize("bad", ["tool,robot", "tool,,user", "Tool", ",", 3, None])
def test_bad_auto_chunk_settings_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="auto_chunk"):
        PicServerSettings(PicConfig(), auto_chunk=bad)


def test_auto_chunk_setting_parses_and_reaches_the_launcher() -> None:
    from sgl_pic.cli.launch_server import build

    assert parse_roles("") == frozenset()
    assert parse_roles(" tool , user ") == frozenset({"tool", "user"})
    assert PicServerSettings(PicConfig(), auto_chunk="tool,document").auto_chunk_roles == {
        "tool",
        "document",
    }
    argv, ns, _ = build(["--model-path", "/m", "--pic-auto-chunk", "tool,user"])
    assert ns.pic_auto_chunk == "tool,user"
    assert not any(a.startswith("--pic-") for a in argv)
    assert build(["--model-path", "/m"])[1].pic_auto_chunk == ""  # off by default


# -- one agent session through the server ----------------------------------------------

SERVER_ROLES = "tool,user,assistant"
N_AVG = 4.0  # as test_sessions.py: at DARIC's default 32 the budget covers every new token
# Turn k + 1 appends the assistant's answer with a tool call, its results and a question.
# Turn 3's second search returns turn 2's result again (an agent re-reading a page).
FOLLOW_UPS = [
    ([("c1", "equator")], [DOCS["C"]], U2),
    ([("c2", "port"), ("c3", "equator")], [DOCS["E"], DOCS["C"]], "Which of the two is a capital?"),
]


@pytest.fixture(scope="module")
def agent_server() -> Iterator[Server]:
    with launch(
        "--pic-auto-chunk",
        SERVER_ROLES,
        "--pic-policy",
        "daric",
        "--pic-n-avg",
        str(N_AVG),
        "--pic-auto-chunk-min-tokens",  # its turns are a sentence each
        "4",
        "--enable-cache-report",
    ) as s:
        yield s


@pytest.mark.sglang
def test_agent_session_reuses_tool_results_and_earlier_turns(agent_server: Server) -> None:
    from sgl_pic.selection import daric_budget

    config = PicConfig(policy="daric", daric_n_avg=N_AVG, auto_chunk_min_tokens=4)
    local = RequestTranslator(config, tokenizer, auto_chunk=parse_roles(SERVER_ROLES))
    # An earlier exchange before the question: the embedded model's template shows no
    # tools, so these are turn 0's chunks.
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": DOCS["B"]},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": U1},
    ]
    stored: set[tuple[int, ...]] = set()  # chunks computed by an earlier miss
    turns: list[tuple[list[int], PromptLayout]] = []
    partial = 0  # turns where DARIC left some new chunk token reused
    for k in range(len(FOLLOW_UPS) + 1):
        body = {
            "model": "default",
            "messages": messages,
            "tools": [SEARCH, WEATHER],
            "temperature": 0,
            "max_tokens": 12,
            "return_input_ids_in_sglext": True,
        }
        mine = local.chat(copy.deepcopy(body))
        assert mine is not None
        toks, layout = mine["input_ids"], decode(mine["custom_params"], config).layout
        before = agent_server.metrics()
        r = requests.post(agent_server.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        d = {key: agent_server.metrics().get(key, 0.0) - before.get(key, 0.0) for key in KEYS}
        out = r.json()
        # The server rendered exactly the prompt the translator renders here.
        assert out["sglext"]["input_ids"] == toks, k
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert d["sgl_pic_requests_total"] == 1, (k, d)
        assert d["sgl_pic_failures_total"] == 0 and d["sgl_pic_fallbacks_total"] == 0, (k, d)
        assert d["sgl_pic_chunk_lookups_total"] == len(layout.chunks), (k, d)
        assert d["sgl_pic_new_tokens_total"] == len(toks) - cached, (k, d)

        span_ids = [tuple(toks[s.start : s.end]) for s in layout.chunks]
        inside = [s for s in layout.chunks if s.end <= cached]
        # Chunks past the device prefix, and one it ends inside (reused from a stored copy
        # past the prefix, or encoded whole and stored when missed).
        past = [(s, t) for s, t in zip(layout.chunks, span_ids, strict=True) if s.end > cached]
        hits = [t for _, t in past if t in stored]
        assert d[PREFIX] == len(inside), (k, cached, d)
        assert d[CONTIG] + d[DISJOINT] == len(hits), (k, d)
        assert d[MISSES] == len(past) - len(hits), (k, d)
        stored.update(t for _, t in past if t not in stored)
        if k == 0:
            assert cached == 0 and d[MISSES] == 2  # the earlier exchange
        else:
            # The previous turn (prompt, and what of its answer SGLang cached) is device
            # prefix: its tool schemas and the earlier question among the chunks inside.
            prev_toks, _ = turns[-1]
            assert cached >= len(prev_toks), (k, cached, len(prev_toks))
            assert tuple(ids(U1)) in {tuple(toks[s.start : s.end]) for s in inside}
            assert d[PREFIX] >= 3, (k, d)
        if k == 2:
            # The repeated search result is a chunk hit at its new place.
            assert tuple(ids(DOCS["C"])) in hits and d[CONTIG] + d[DISJOINT] >= 1, (k, d)
        # The server recomputed what DARIC selects on the translator's layout.
        sel = offline_recompute(layout, cached, config)
        assert d["sgl_pic_recomputed_tokens_total"] == sel.numel(), (k, d)
        partial += sel.numel() < len(toks) - cached
        turns.append((toks, layout))

        if k < len(FOLLOW_UPS):
            calls, results, question = FOLLOW_UPS[k]
            answer = out["choices"][0]["message"]["content"] or ""
            messages = [
                *messages,
                {
                    "role": "assistant",
                    "content": answer,
                    "tool_calls": [call(cid, "search", q) for cid, q in calls],
                },
                *(
                    {"role": "tool", "tool_call_id": cid, "content": res}
                    for (cid, _), res in zip(calls, results, strict=True)
                ),
                {"role": "user", "content": question},
            ]

    assert partial > 0  # the selection comparison can tell a partial selection from all

    # DARIC's budgets on the session's layouts: within a turn they grow with the segment
    # index; a segment kept at its index in the next turn gets no more (Proposition 1).
    strictly_smaller = 0
    for k, (_, layout) in enumerate(turns):
        segs = layout.segments()
        b = daric_budget(len(segs), config.daric_n_avg, config.daric_r, config.daric_mtaf)
        assert list(b.per_chunk_tokens) == sorted(b.per_chunk_tokens), k
        if k + 1 == len(turns):
            continue
        nxt = turns[k + 1][1].segments()
        b_next = daric_budget(len(nxt), config.daric_n_avg, config.daric_r, config.daric_mtaf)
        kept = 0
        for i in range(1, len(segs)):
            if nxt[i] != segs[i]:
                break  # the segments after it moved (the question became a chunk)
            kept += 1
            assert b_next.per_chunk[i - 1] <= b.per_chunk[i - 1] + 1e-9, (k, i)
            strictly_smaller += b_next.per_chunk[i - 1] < b.per_chunk[i - 1] - 1e-9
        assert kept >= 2, k  # at least the earlier exchange keeps its place
    assert strictly_smaller > 0


# -- what SGLang's own chat path would render, and what it cannot take ------------------


def test_a_final_assistant_message_gives_the_prompt_sglang_renders() -> None:
    """Without continue_final_message SGLang renders a final assistant message as a user
    turn of its text; with it, the text is cut off and its tokens appended to the
    rendering's, each one a piece of the chunked prompt."""
    msgs = [
        {"role": "user", "content": DOCS["A"], "pic_chunk": True},
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1},
    ]
    plain = [{k: v for k, v in m.items() if k != "pic_chunk"} for m in msgs]
    out = chat(translator(), {"messages": msgs})
    assert out is not None and chunk_texts(out) == [DOCS["A"]]
    assert tokenizer().decode(out["input_ids"]) == sglang_render("", {"messages": plain})
    assert sglang_render("", {"messages": plain}).endswith(
        f"<|im_start|>user\n{A1}<|im_end|>\n<|im_start|>assistant\n"
    )
    body = {"messages": msgs, "continue_final_message": True}
    out = chat(translator(), body)
    assert out is not None and chunk_texts(out) == [DOCS["A"]]
    head = sglang_render("", {"messages": plain[:2]})
    assert out["input_ids"] == ids_of(out, DOCS["A"], head) + ids(A1)
    # The continued text is a piece too, tokenized on its own: marked, a chunk.
    long_answer = {"role": "assistant", "content": DOCS["B"], "pic_chunk": True}
    out = chat(
        translator(ALL), {"messages": [*plain[:2], long_answer], "continue_final_message": True}
    )
    assert out is not None and chunk_texts(out)[-1] == DOCS["B"]
    assert out["input_ids"][-len(ids(DOCS["B"])) :] == ids(DOCS["B"])


def ids_of(out: dict[str, Any], chunk: str, text: str) -> list[int]:
    """``text`` tokenized with ``chunk`` (which it holds once) tokenized on its own."""
    at = text.index(chunk)
    return ids(text[:at]) + ids(chunk) + ids(text[at + len(chunk) :])


@pytest.mark.parametrize("auto", [frozenset(), ALL])
def test_text_items_and_reasoning_render_as_sglang_renders_them(auto: frozenset[str]) -> None:
    # SGLang hands a string-content template (the embedded model's) a message's text items
    # joined by a space, and every field of the message that is not null.
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format

    assert detect_jinja_template_content_format(tokenizer().chat_template) == "string"
    items = [{"type": "text", "text": DOCS["B"]}, {"type": "text", "text": "forty-two."}]
    msgs = [
        {"role": "tool", "content": DOCS["A"]},
        {"role": "user", "content": [{**items[0], "pic_chunk": True}, items[1]]},
        {"role": "assistant", "content": A1, "reasoning_content": "Think first."},
        {"role": "user", "content": items},
    ]
    out = chat(translator(auto), {"messages": msgs})
    assert out is not None
    plain = [
        {k: v for k, v in m.items() if k != "pic_chunk"} | {"content": items}
        if isinstance(m["content"], list)
        else m
        for m in msgs
    ]
    assert tokenizer().decode(out["input_ids"]) == sglang_render("", {"messages": plain})
    assert chunk_texts(out)[0 if not auto else 1] == DOCS["B"]


def test_content_lists_are_chunked_where_the_template_reads_them_itself() -> None:
    # SGLang hands such a template the list; its items are found in the rendering as any
    # content is.
    tok = copy.copy(tokenizer())
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{{ c['text'] }}|{% endfor %}{% endif %}"
        "{% endfor %}"
    )
    t = RequestTranslator(SHORT, lambda: tok, MarkSigner("k"), auto_chunk=ALL)
    items = [{"type": "text", "text": DOCS["B"]}, {"type": "text", "text": U1}]
    marked = [
        {"role": "tool", "content": DOCS["A"]},
        {"role": "user", "content": [{**items[0], "pic_chunk": True}, items[1]]},
    ]
    out = chat(t, {"messages": marked})
    assert out is not None and chunk_texts(out) == [DOCS["A"], DOCS["B"]]
    assert tokenizer().decode(out["input_ids"]) == (f"<tool>{DOCS['A']}<user>{DOCS['B']}|{U1}|")


def test_lone_surrogates_are_refused_before_the_tokenizer_sees_them() -> None:
    for body in (
        {
            "messages": [
                {"role": "tool", "content": "\ud800 " + DOCS["A"]},
                {"role": "user", "content": U1},
            ]
        },
        {
            "messages": [{"role": "user", "content": U1}],
            "tools": [tool("f", "\udfff " + DOCS["B"])],
        },
        {"messages": [{"role": "user", "content": "\ud800" + DOCS["C"], "pic_chunk": True}]},
    ):
        with pytest.raises(LayoutError, match="lone UTF-16 surrogate"):
            chat(translator(ALL, template="qwen25"), body)


def test_text_that_would_read_as_markers_is_left_to_sglang() -> None:
    msgs = [{"role": "tool", "content": DOCS["A"]}, {"role": "user", "content": "a \ue004 b"}]
    assert chat(translator(ALL), {"messages": msgs}) is None
    marked = [{**msgs[0], "pic_chunk": True}, msgs[1]]
    with pytest.raises(LayoutError, match="private-use code points"):
        chat(translator(ALL), {"messages": marked})
