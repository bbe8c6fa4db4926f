"""Chat-template fixtures (tests/support/templates/*.jinja, written by this project in
the structure each model family documents) on the embedded model's tokenizer, and
generated agent requests to render with them."""

from __future__ import annotations

import copy
import json
import random
from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "templates"
# Fixture name -> SGLang's tool-call parser for the family (srt/function_call).
FAMILIES: dict[str, str] = {
    "qwen25": "qwen25",
    "qwen3": "qwen25",
    "llama3": "llama3",
    "mistral": "mistral",
}
EMBEDDED = "smollm2"  # the embedded model's own template: no tool section


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@cache
def templated(name: str) -> Any:
    """The embedded model's tokenizer carrying fixture ``name``'s template (its own for
    ``EMBEDDED``)."""
    from tests.support.prompts import tokenizer

    tok = copy.copy(tokenizer())
    if name != EMBEDDED:
        tok.chat_template = template_text(name)
    return tok


def tool(name: str, description: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": v, "description": f"The {k}."} for k, v in props.items()
                },
                "required": sorted(props),
            },
        },
    }


TOOLS: list[dict[str, Any]] = [
    tool("search", "Search the travel guide for pages about a subject.", query="string"),
    tool("weather", "Today's weather forecast in a city, in degrees Celsius.", city="string"),
    tool("book", "Book a hotel room in a city for one night.", city="string", date="string"),
    tool(
        "convert",
        "Convert an amount of money between two currencies.",
        amount="number",
        source="string",
        target="string",
    ),
    tool(
        "route",
        "Find a train route between two cities with its duration.",
        start="string",
        end="string",
    ),
]

SYSTEM = "You are a travel agent. Use the tools when they help, and answer briefly."
RESULTS = [
    "Quito lies about 25 kilometres south of the equator, at 2,850 metres above sea level.",
    "Valparaiso is a port city on the coast of Chile, built on dozens of steep hills.",
    "Tomorrow in Tromso: light snow, -4 degrees, wind from the north at 20 km/h.",
    "Hotel Alameda, Cusco: one double room left on 12 March, 85 USD per night.",
    "The train from Lyon to Geneva takes 1 hour 50 minutes, with six trains a day.",
]
QUESTIONS = [
    "Which city lies almost exactly on the equator?",
    "And which city is a port famous for its funiculars?",
    "What will the weather be like in Tromso tomorrow?",
    "Can you book me a room in Cusco on 12 March?",
    "How long is the train from Lyon to Geneva?",
]


def call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def agent_request(rng: random.Random, family: str) -> dict[str, Any]:
    """A generated agent request: a subset of the tools in some order, a system prompt or
    none, one to three turns of question, tool call(s), results and answers, sometimes a
    final assistant message (continued or not), sometimes template options."""
    tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.8 or family == "qwen25":
        messages.append({"role": "system", "content": SYSTEM})
    turns = rng.randint(1, 3)
    questions = rng.sample(QUESTIONS, turns)
    n = 0
    for t in range(turns):
        messages.append({"role": "user", "content": questions[t]})
        if t == turns - 1 and rng.random() < 0.4:
            break  # the question is the last message
        calls = [
            call(f"c{n + k:08d}", "search", query=rng.choice(["equator", "port", "snow"]))
            for k in range(1 if family == "llama3" else rng.randint(1, 2))
        ]
        n += len(calls)
        content = None if rng.random() < 0.5 else "Let me look that up."
        if family == "llama3":
            content = None
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for c in calls:
            messages.append(
                {"role": "tool", "tool_call_id": c["id"], "content": rng.choice(RESULTS)}
            )
        if t < turns - 1 or rng.random() < 0.5:
            messages.append({"role": "assistant", "content": rng.choice(RESULTS[:2])})
    body: dict[str, Any] = {"model": "m", "messages": messages, "tools": tools}
    if messages[-1]["role"] == "assistant" and rng.random() < 0.5:
        body["continue_final_message"] = True
    if family == "qwen3":
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    elif rng.random() < 0.3:
        body["reasoning_effort"] = "low"
    return body


ALL_ROLES = frozenset({"tool", "document", "user", "assistant"})


def translator(name: str, config: Any = None) -> Any:
    """A translator auto-chunking every role on the tokenizer carrying fixture ``name``."""
    from sgl_pic.config import PicConfig
    from sgl_pic.core.spans import MarkSigner
    from sgl_pic.http.middleware import RequestTranslator

    tok = templated(name)
    config = config or PicConfig(auto_chunk_min_tokens=4)
    return RequestTranslator(config, lambda: tok, MarkSigner("k"), auto_chunk=ALL_ROLES)


def sglang_text(name: str, body: dict[str, Any]) -> tuple[str, str]:
    """What SGLang's chat path renders for ``body`` with fixture ``name``: the template's
    text, and the continued final message its tokens are followed by ('' for none)."""
    from sgl_pic.http.chat_render import ChatTemplate

    ct = ChatTemplate(templated(name))
    inputs = ct.inputs(body, {})
    text, _ = ct.render(inputs)
    return text, inputs.prefix or ""


def boundary_diff(chunked: list[int], plain: list[int]) -> list[tuple[int, int]]:
    """The blocks where the chunked prompt's ids differ from the plain tokenization's:
    (tokens on the chunked side, tokens on the plain side) each."""
    from difflib import SequenceMatcher

    ops = SequenceMatcher(None, chunked, plain, autojunk=False).get_opcodes()
    return [(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal"]


def boundary_counts(name: str, requests: int, seed: int = 0) -> dict[str, Any]:
    """Over ``requests`` generated agent requests with fixture ``name``: prompt tokens,
    pieces, text mismatches (must be 0) and the tokens that differ from the plain
    tokenization of the same text (at piece boundaries)."""
    from sgl_pic.config import PicConfig
    from sgl_pic.core.spans import decode
    from tests.support.prompts import ids

    rng = random.Random(seed)
    t = translator(name)
    tok = templated(name)
    stats = {
        "requests": 0,
        "chunked": 0,
        "prompt_tokens": 0,
        "chunks": 0,
        "text_mismatches": 0,
        "differing_blocks": 0,
        "differing_tokens": 0,
        "largest_block": 0,
    }
    for _ in range(requests):
        body = agent_request(rng, name)
        out = t.chat(copy.deepcopy(body))
        stats["requests"] += 1
        if out is None:
            continue
        text, prefix = sglang_text(name, body)
        plain = ids(text) + (ids(prefix) if prefix else [])
        chunked = out["input_ids"]
        if tok.decode(chunked) != text + prefix:
            stats["text_mismatches"] += 1
        blocks = boundary_diff(chunked, plain)
        stats["chunked"] += 1
        stats["prompt_tokens"] += len(chunked)
        stats["chunks"] += len(decode(out["custom_params"], PicConfig()).layout.chunks)
        stats["differing_blocks"] += len(blocks)
        stats["differing_tokens"] += sum(max(b) for b in blocks)
        stats["largest_block"] = max([stats["largest_block"], *(max(b) for b in blocks)])
    return stats
