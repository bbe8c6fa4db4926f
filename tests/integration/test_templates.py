"""Chunked chat prompts on the model families' own templates (tests/support/templates,
written by this project in each family's documented structure) and on generated templates:
the prompt's text is the template's rendering byte for byte; its token ids differ from the
plain tokenization only at piece boundaries, by a few tokens; a tool seen before, in another
order or subset, gives the same chunk; SGLang's tool parser for the family reads the
template's own tool-call format. The embedded model's tokenizer; no server."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.core.spans import MarkSigner, decode
from tests.support.chat_templates import (
    ALL_ROLES,
    EMBEDDED,
    FAMILIES,
    TOOLS,
    agent_request,
    boundary_counts,
    boundary_diff,
    call,
    sglang_text,
    templated,
    translator,
)
from tests.support.prompts import ids, tokenizer

TEMPLATES = [*FAMILIES, EMBEDDED]


def chunks(out: dict[str, Any]) -> list[list[int]]:
    layout = decode(out["custom_params"], PicConfig()).layout
    return [out["input_ids"][s.start : s.end] for s in layout.chunks]


def tool_chunks(out: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tool name -> its chunk's ids, for the chunks that are a tool's schema."""
    found = {}
    for c in chunks(out):
        try:
            schema = json.loads(tokenizer().decode(c))
        except ValueError:
            continue  # not JSON: a message's text
        if isinstance(schema, dict):
            found[schema.get("function", schema)["name"]] = tuple(c)
    return found


@pytest.mark.parametrize("name", TEMPLATES)
def test_chunked_prompts_are_the_templates_rendering(name: str) -> None:
    rng = random.Random(TEMPLATES.index(name))
    t = translator(name)
    tok = templated(name)
    seen_options = set()
    for _ in range(12):
        body = agent_request(rng, name)
        seen_options |= set(body) & {
            "continue_final_message",
            "chat_template_kwargs",
            "reasoning_effort",
        }
        out = t.chat(copy.deepcopy(body))
        if out is None:
            # Only a template without a tool section on a request of a single question
            # has nothing to chunk.
            assert name == EMBEDDED and len(body["messages"]) <= 2, body
            continue
        text, prefix = sglang_text(name, body)
        # Byte for byte: the ids decode to SGLang's rendering, and the text is what the
        # template alone renders with the request's own messages, tools and options.
        assert tok.decode(out["input_ids"]) == text + prefix
        plain = ids(text) + (ids(prefix) if prefix else [])
        # The ids differ from the plain tokenization only in small blocks (a merge across a
        # piece boundary): each block at most a few tokens.
        blocks = boundary_diff(out["input_ids"], plain)
        assert all(max(b) <= 4 for b in blocks), blocks
        assert len(blocks) <= 2 * len(chunks(out)) + 4 * len(body["messages"])
        assert out["tools"] == body["tools"]  # SGLang still parses calls with them
    assert seen_options  # the generated requests carried template options


def test_template_options_change_the_prompt_and_are_chunked() -> None:
    rng = random.Random(7)
    body = agent_request(rng, "qwen3")
    outs = {}
    for thinking in (True, False):
        b = {**body, "chat_template_kwargs": {"enable_thinking": thinking}}
        b.pop("continue_final_message", None)
        out = translator("qwen3").chat(copy.deepcopy(b))
        assert out is not None
        outs[thinking] = out
        text, _ = sglang_text("qwen3", b)
        assert tokenizer().decode(out["input_ids"]) == text
    assert outs[True]["input_ids"] != outs[False]["input_ids"]
    # The same chunks either way: only the generation prompt differs.
    assert chunks(outs[True]) == chunks(outs[False])


def sglang_prompt_ids(
    name: str, body: dict[str, Any], tok: Any = None, defaults: dict[str, Any] | None = None
) -> list[int]:
    """The prompt ids SGLang's own chat path makes of ``body`` with fixture ``name`` (or
    tokenizer ``tok``; ``defaults``: the server's default template options):
    ``OpenAIServingChat._process_messages`` of the installed SGLang, on an instance holding
    the state its Jinja path reads (a template given as Jinja, no chat encoder, no
    reasoning parser, the family's tool parser), as its constructor would set it for the
    tokenizer, after the step of ``_convert_to_internal_request`` that precedes it."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()  # the sgl_kernel / torchvision stand-ins serving_chat imports
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format

    tok = tok or templated(name)
    serving = object.__new__(OpenAIServingChat)
    serving.template_manager = SimpleNamespace(
        jinja_template_content_format=detect_jinja_template_content_format(tok.chat_template),
        jinja_template_may_reorder_tool_results=False,
        reasoning_config=None,
        python_chat_template=None,
        chat_template_name=None,
    )
    serving.tokenizer_manager = SimpleNamespace(tokenizer=tok)
    serving._encoding_adapter = None
    serving.chat_encoding_spec = None
    serving.is_minimax_m3 = serving.is_gpt_oss = serving.is_gemma4 = False
    serving._prompt_text_round_trip_is_lossy = False
    serving._tokenizer_auto_adds_specials = len(tok.encode("")) > 0
    serving._chat_template_cache = OrderedDict()
    serving.default_chat_template_kwargs = defaults or {}
    serving.reasoning_parser = None
    serving._reasoning_detector = None
    serving.tool_call_parser = FAMILIES.get(name)
    request = ChatCompletionRequest(**copy.deepcopy(body))
    # _convert_to_internal_request (serving_chat.py, before _process_messages; no Hunyuan
    # reasoning parser): the template options' effort moves to the request's field.
    effort = (
        request.chat_template_kwargs.pop("reasoning_effort", None)
        if request.chat_template_kwargs
        else None
    )
    if effort is not None:
        request.reasoning_effort = effort
    return list(serving._process_messages(request, is_multimodal=False).prompt_ids)


def test_reasoning_effort_and_the_servers_default_options_as_sglang_merges_them() -> None:
    """A ``reasoning_effort`` in the request's template options is moved out of them
    before the server's defaults are merged in: a default effort then wins over it."""
    from sgl_pic.http.chat_render import ChatTemplate

    tok = copy.copy(tokenizer())
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "effort={{ reasoning_effort }} think={{ enable_thinking }}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    bodies = [
        {"chat_template_kwargs": {"reasoning_effort": "high"}},
        {"chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True}},
        {"reasoning_effort": "medium", "chat_template_kwargs": {"reasoning_effort": "high"}},
        {"reasoning_effort": "medium"},
        {"chat_template_kwargs": {}},
        {},
    ]
    defaults_cases = [
        {},
        {"reasoning_effort": "low"},
        {"enable_thinking": False},
        {"reasoning_effort": "low", "enable_thinking": False},
    ]
    seen = set()
    for defaults in defaults_cases:
        for extra in bodies:
            body = {"model": "m", "messages": msgs, **extra}
            want = tok.decode(sglang_prompt_ids(EMBEDDED, body, tok, defaults))
            template = ChatTemplate(tok)
            got = template.render(template.inputs(copy.deepcopy(body), defaults))[0]
            assert got == want, (defaults, extra)
            seen.add(got)
    # The server's default effort wins over the request's template option.
    body = {"model": "m", "messages": msgs, "chat_template_kwargs": {"reasoning_effort": "high"}}
    template = ChatTemplate(tok)
    text = template.render(template.inputs(body, {"reasoning_effort": "low"}))[0]
    assert text.endswith("effort=low think=")
    assert len(seen) > 4


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_text_is_what_sglangs_chat_path_renders(name: str) -> None:
    """SGLang's own chat path, run on the same requests, makes exactly the plain
    tokenization of the chunked prompt's text: the text is SGLang's prompt."""
    rng = random.Random(5)
    t = translator(name)
    for _ in range(6):
        body = agent_request(rng, name)
        text, prefix = sglang_text(name, body)
        assert sglang_prompt_ids(name, body) == ids(text) + (ids(prefix) if prefix else [])
        out = t.chat(copy.deepcopy(body))
        if out is not None:
            assert tokenizer().decode(out["input_ids"]) == text + prefix


def test_the_mirrored_helpers_agree_with_sglangs() -> None:
    """chat_render's copies of two serving_chat helpers (importing serving_chat pulls in
    SGLang's model tree) do what the originals do."""
    from sgl_pic.binding.cpu_env import activate_cpu_stubs
    from sgl_pic.http.chat_render import decode_tool_call_arguments, join_tool_content
    from sgl_pic.layout import LayoutError

    activate_cpu_stubs()
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
        normalize_tool_content,
    )

    for content in ([{"type": "text", "text": "a"}, "b"], [{"type": "image"}], "x", None):
        for role in ("tool", "user"):
            assert join_tool_content(role, content) == normalize_tool_content(role, content)
    for args in ('{"q": 1}', "[1]", "not json", '{"big": 1e3, "s": "\\u00e9"}'):
        msg = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}
        mine, theirs = copy.deepcopy(msg), copy.deepcopy(msg)
        try:
            normalize_assistant_tool_call_arguments(theirs, strict=True)
        except ValueError as e:
            with pytest.raises(LayoutError, match=str(e)[:30]):
                decode_tool_call_arguments(mine)
            continue
        decode_tool_call_arguments(mine)
        assert mine == theirs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tool_seen_before_in_another_order_or_subset_gives_the_same_chunk(name: str) -> None:
    t = translator(name)
    rng = random.Random(3)
    first = None
    for k in range(6):
        body = agent_request(rng, name)
        body["tools"] = TOOLS if k == 0 else rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
        out = t.chat(copy.deepcopy(body))
        assert out is not None
        got = tool_chunks(out)
        shown = {tl["function"]["name"] for tl in body["tools"]}
        assert set(got) == shown, (k, set(got), shown)  # every tool is a chunk
        if first is None:
            first = got
        else:
            assert got == {n: first[n] for n in got}, k  # same ids: a hit


# SGLang's tool parsers (srt/function_call) read calls from the response path: the text the
# model generates after the generation prompt, in the format its template shows in history.
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_familys_tool_parser_reads_the_templates_call_format(name: str) -> None:
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    tools = TOOLS[:3]
    history = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Book a room in Cusco on 12 March."},
    ]
    calls = [call("c00000001", "book", city="Cusco", date="12 March")]
    if name != "llama3":  # Llama 3 shows one call per turn
        calls.append(call("c00000002", "weather", city="Cusco"))
    answered = [*history, {"role": "assistant", "content": None, "tool_calls": calls}]
    before, _ = sglang_text(name, {"messages": history, "tools": tools})
    after, _ = sglang_text(
        name,
        {
            "messages": [*answered, {"role": "tool", "tool_call_id": "c00000001", "content": "ok"}],
            "tools": tools,
        },
    )
    assert after.startswith(before)
    response = after[len(before) :]
    for stop in ("<|im_start|>user", "[TOOL_RESULTS]", "<|im_end|>\n", "<|eot_id|>"):
        response = response.split(stop)[0]
    eos = templated(name).eos_token
    response = response.removesuffix(eos) if name == "mistral" else response
    parser = FunctionCallParser([Tool(**tl) for tl in tools], FAMILIES[name])
    normal, parsed = parser.parse_non_stream(response)
    assert [(p.name, json.loads(p.parameters)) for p in parsed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ], response
    assert normal.strip() == ""


def test_boundary_counts_are_small_and_text_is_exact() -> None:
    """The figures bench/template_boundaries.py writes: no text differs, and the tokens that
    differ from the plain tokenization stay a small share of the prompt."""
    for name in TEMPLATES:
        stats = boundary_counts(name, 6)
        assert stats["text_mismatches"] == 0, (name, stats)
        assert stats["chunked"] >= 5, (name, stats)
        assert stats["differing_tokens"] <= 0.06 * stats["prompt_tokens"], (name, stats)


# -- generated templates ---------------------------------------------------------------

_TOJSON_OPTS = ["", "(indent=2)", "(indent=4)", "(separators=(',', ':'))", "(sort_keys=true)"]


def generated_template(rng: random.Random) -> str:
    """A chat template built from random parts: the tools serialised with tojson in a loop
    (each tool, or its function), as the whole list, or inside other text; in the system
    turn, the first user turn or before the last user turn; contents plain or trimmed."""
    opts = rng.choice(_TOJSON_OPTS)
    how = rng.choice(["loop", "function", "list", "inline"])
    sep = rng.choice(["\\n", "\\n\\n", ", ", ""])
    if how == "loop":
        section = f"{{% for t in tools %}}{{{{ t | tojson{opts} }}}}{sep}{{% endfor %}}"
    elif how == "function":
        section = f"{{% for t in tools %}}- {{{{ t.function | tojson{opts} }}}}{sep}{{% endfor %}}"
    elif how == "list":
        section = f"{{{{ tools | tojson{opts} }}}}"
    else:
        section = (
            "{% for t in tools %}{{ 'Tool ' ~ loop.index ~ ': ' ~ (t | tojson"
            f"{opts}) ~ ' (callable)' }}}}{sep}{{% endfor %}}"
        )
    section = f"{{% if tools %}}<tools>{section}</tools>{{% endif %}}"
    where = rng.choice(["system", "first_user", "last_user"])
    content = rng.choice(["{{ m.content }}", "{{ m.content | trim }}", "[{{ m.content }}]"])
    head = section if where == "system" else ""
    return (
        "{% set ns = namespace(first=true, last=-1) %}"
        "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
        "{% endif %}{% endfor %}"
        f"<sys>{head}</sys>"
        "{% for m in messages %}<{{ m.role }}>"
        + (
            f"{{% if m.role == 'user' and ns.first %}}{section}{{% set ns.first = false %}}"
            "{% endif %}"
            if where == "first_user"
            else f"{{% if loop.index0 == ns.last %}}{section}{{% endif %}}"
            if where == "last_user"
            else ""
        )
        + f"{{% if m.content %}}{content}{{% endif %}}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
        "</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )


def test_the_mechanism_does_not_depend_on_a_fixture() -> None:
    """On generated templates: the prompt is the template's rendering byte for byte, every
    tool the template serialises with tojson is a chunk, and a tool gives the same chunk
    in every order and subset."""
    rng = random.Random(11)
    base = tokenizer()
    for case in range(40):
        source = generated_template(rng)
        tok = copy.copy(base)
        tok.chat_template = source
        from sgl_pic.http.middleware import RequestTranslator

        t = RequestTranslator(
            PicConfig(auto_chunk_min_tokens=4),
            lambda tok=tok: tok,
            MarkSigner("k"),
            auto_chunk=ALL_ROLES,
        )
        seen: dict[str, tuple[int, ...]] = {}
        for _ in range(3):
            body = agent_request(rng, "generated")
            body.pop("chat_template_kwargs", None)
            out = t.chat(copy.deepcopy(body))
            assert out is not None, (case, source)
            from sgl_pic.http.chat_render import ChatTemplate

            ct = ChatTemplate(tok)
            inputs = ct.inputs(body, {})
            text, _ = ct.render(inputs)
            assert tok.decode(out["input_ids"]) == text + (inputs.prefix or ""), (case, source)
            got = tool_chunks(out)
            shown = {tl["function"]["name"] for tl in body["tools"]}
            assert set(got) == shown, (case, source, set(got), shown)
            for n, c in got.items():
                assert seen.setdefault(n, c) == c, (case, source, n)
