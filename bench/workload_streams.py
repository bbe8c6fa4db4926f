"""The four request streams of ``bench/workloads.py``, generated from local data with a fixed
seed: each request once with chunk marks (sgl-pic) and once without (SGLang's prefix
caching), over the same text.

- ``rag_churn``: /generate, a system chunk, 3-5 MuSiQue passages, half of them drawn by Zipf
  popularity from a small hot pool and half novel (never seen before: the churn that floods
  a cache), and the question.
- ``agent``: multi-turn OpenAI chat sessions. Each turn the agent's scripted tool call is
  answered by a tool result (a passage, Zipf-popular across sessions), and the session's
  memory notes (``name: "document"`` messages at the front) come back reordered, which
  breaks the prefix of everything after them.
- ``tools``: OpenAI chat with a random subset of synthetic tool schemas in random order, and
  a question. Both forms send ``tools``; the servers of ``agent`` and ``tools`` run the
  embedded model with a tool-aware chat template (``tool_template_model``: the Qwen2.5
  fixture of tests/support/templates, which renders the tools in a <tools> section), so
  SGLang renders them in the baseline and sgl-pic finds each schema in the same rendering
  and makes it a chunk.
- ``fewshot``: /generate, an instruction, 6 of 12 demonstrations (passage, question,
  answer) in a random order each time, and a question.

Assistant turns are scripted, not the model's output, so both runs send identical
conversations. Texts are cut to a token budget so that prompts stay at a few hundred to
~1.5k tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, NamedTuple

from _common import ROOT, embedded_tokenizer

DELIM = "<|pic_chunk|>"
# The chat template the servers of these workloads carry: one of the tests' fixtures.
TOOL_TEMPLATE = ROOT / "tests" / "support" / "templates" / "qwen25.jinja"
TEMPLATED_WORKLOADS = ("agent", "tools")
SYSTEM = "You are a helpful assistant. Use the context to answer in a few words."


class Request(NamedTuple):
    """One request of a session, in both forms. endpoint: "generate" or "chat"."""

    endpoint: str
    pic: dict[str, Any]  # marked (or auto-chunked) body
    base: dict[str, Any]  # the same prompt for plain SGLang


Session = list[Request]  # requests sent one after another; sessions run concurrently


class Streams:
    """Text sources shared by the generators: passages cut to ``passage_tokens``, and
    questions with answers."""

    def __init__(self, data: Path, passage_tokens: int, max_new_tokens: int) -> None:
        # Here, not at the top: sgl_pic.prompts imports torch, and the scripts built on
        # these streams answer --help without it.
        from sgl_pic.prompts import load_rag_examples, truncate_tokens

        self.tok = embedded_tokenizer()
        examples = load_rag_examples(data)
        texts = [p for ex in examples for p in ex.passages]
        random.Random(0).shuffle(texts)
        self.passages = [truncate_tokens(self.tok, t, passage_tokens) for t in texts]
        self.qa = [(ex.question, ex.answers[0] if ex.answers else "") for ex in examples]
        self.max_new_tokens = max_new_tokens

    # ------------------------------------------------------------------ bodies
    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def generate(self, chunks: list[str], tail: str) -> Request:
        """/generate with token ids: each chunk and the tail tokenized on their own, so
        both forms send the same tokens."""
        ids: list[int] = []
        spans = []
        for c in chunks:
            t = self.ids(c)
            spans.append([len(ids), len(ids) + len(t)])
            ids += t
        ids += self.ids(tail)
        sp = {"temperature": 0, "max_new_tokens": self.max_new_tokens}
        base = {"input_ids": ids, "sampling_params": sp}
        return Request("generate", {**base, "pic": {"chunks": spans}}, base)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Request:
        body: dict[str, Any] = {
            "model": "default",
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.max_new_tokens,
        }
        if tools:
            body["tools"] = tools  # the server's template renders them, in both forms
        return Request("chat", {**body, "pic": {"auto_chunk": True}}, body)


def tool_template_model(template: Path = TOOL_TEMPLATE) -> Path:
    """The embedded model carrying ``template`` as its chat template: a directory beside it
    of links to its files, with its own ``chat_template.jinja`` (made once, rewritten when
    the template changed). The servers of ``TEMPLATED_WORKLOADS`` run it."""
    from sgl_pic.model.embedded import ensure_embedded_model

    src = ensure_embedded_model().path
    dest = src.parent / f"{src.name}-{template.stem}-template"
    dest.mkdir(exist_ok=True)
    for f in src.iterdir():
        link = dest / f.name
        if f.name in ("chat_template.jinja", "tokenizer_config.json") or link.exists():
            continue
        link.symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # the .jinja file holds it
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    text = template.read_text()
    jinja = dest / "chat_template.jinja"
    if not jinja.exists() or jinja.read_text() != text:
        jinja.write_text(text)
    return dest


def _zipf(rng: random.Random, n: int, s: float = 1.0) -> int:
    return rng.choices(range(n), weights=[1.0 / (r + 1) ** s for r in range(n)])[0]


def rag_churn(src: Streams, n: int, seed: int, hot: int = 24) -> list[Session]:
    rng = random.Random(seed)
    system = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    novel = hot  # passages past the hot pool, each used once
    out: list[Session] = []
    for _ in range(n):
        k = rng.randint(3, 5)
        chosen: list[int] = []
        while len(chosen) < k:
            if rng.random() < 0.5:
                i = _zipf(rng, hot)
            else:
                i, novel = novel, novel + 1
            if i not in chosen:
                chosen.append(i)
        q, _ = src.qa[rng.randrange(len(src.qa))]
        chunks = [system, *(f"Passage: {src.passages[i]}\n\n" for i in chosen)]
        tail = (
            f"[{rng.getrandbits(32):08x}] Question: {q}\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
        )
        out.append([src.generate(chunks, tail)])
    return out


def agent(src: Streams, n: int, seed: int, turns: int = 5, pool: int = 40) -> list[Session]:
    rng = random.Random(seed)
    base_pool = 400  # passages of this workload: away from rag_churn's hot pool
    tools = synthetic_tools()
    out: list[Session] = []
    for s in range(-(-n // turns)):
        notes = [
            f"Memory {j}: the user {src.passages[base_pool + 200 + 3 * s + j][:160]}"
            for j in range(3)
        ]
        kit = rng.sample(tools, 3)
        history: list[dict[str, Any]] = []
        session: Session = []
        for t in range(turns):
            if len(session) + sum(len(x) for x in out) >= n:
                break
            q, _ = src.qa[rng.randrange(len(src.qa))]
            if t:
                call = {
                    "id": f"call_{s}_{t}",
                    "type": "function",
                    "function": {"name": kit[0]["function"]["name"], "arguments": "{}"},
                }
                p = src.passages[base_pool + _zipf(rng, pool)]
                history += [
                    {
                        "role": "assistant",
                        "content": f"Let me look that up ({t}).",
                        "tool_calls": [call],
                    },
                    {"role": "tool", "tool_call_id": call["id"], "content": p},
                ]
            rng.shuffle(notes)  # the agent framework rebuilds its memory block each turn
            messages = [
                {"role": "system", "content": SYSTEM},
                *({"role": "user", "name": "document", "content": x} for x in notes),
                *history,
                {"role": "user", "content": q},
            ]
            session.append(src.chat(messages, kit))
            history.append({"role": "user", "content": q})
        out.append(session)
    return out


def tools_calls(src: Streams, n: int, seed: int) -> list[Session]:
    rng = random.Random(seed)
    tools = synthetic_tools()
    out: list[Session] = []
    for _ in range(n):
        kit = rng.sample(tools, rng.randint(4, 8))  # a subset, in a random order
        q, _ = src.qa[rng.randrange(len(src.qa))]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        out.append([src.chat(messages, kit)])
    return out


def fewshot(src: Streams, n: int, seed: int, demos: int = 12, shots: int = 6) -> list[Session]:
    rng = random.Random(seed)
    base_pool = 800
    pool = [
        f"Passage: {src.passages[base_pool + i][:400]}\nQuestion: {q}\nAnswer: {a}\n\n"
        for i, (q, a) in enumerate(src.qa[:demos])
    ]
    head = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nAnswer like the examples.\n\n"
    )
    out: list[Session] = []
    for _ in range(n):
        chosen = rng.sample(range(demos), shots)  # a subset, permuted
        q, _ = src.qa[demos + rng.randrange(len(src.qa) - demos)]
        tail = f"Question: {q}\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
        out.append([src.generate([head, *(pool[i] for i in chosen)], tail)])
    return out


WORKLOADS = {"rag_churn": rag_churn, "agent": agent, "tools": tools_calls, "fewshot": fewshot}


def server_warmup(src: Streams, n: int, passages: int = 6) -> list[Request]:
    """``n`` requests of the streams' size (``passages`` passages each) from the last passages
    of ``src``, past those the workloads draw by index (rag_churn reaches about 400, agent
    700, fewshot 811): a server's first large forwards pay a one-time cost
    (``bench/workloads.py``) that they take instead of a stream's first requests. The data
    repeats some paragraphs, so a few of these recur in the streams (five of the 24, with
    the default seed); that is harmless, since the warm-up is sent plain (no chunk is
    stored) and the prefix tree is flushed after it."""
    if n * passages > len(src.passages) - 900:
        raise ValueError(f"{n} warm-up requests of {passages} passages reach below passage 900")
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    tail = "Question: which of these comes first?<|im_end|>\n<|im_start|>assistant\n"
    out = []
    for r in range(n):
        first = len(src.passages) - (r + 1) * passages
        chunks = [head, *(f"Passage: {p}\n\n" for p in src.passages[first : first + passages])]
        out.append(src.generate(chunks, tail))
    return out


def synthetic_tools(count: int = 20) -> list[dict[str, Any]]:
    """``count`` function schemas with a fixed text each (no randomness: every run and
    both forms see the same tools)."""
    verbs = [
        "search",
        "get",
        "create",
        "update",
        "delete",
        "list",
        "send",
        "book",
        "convert",
        "translate",
    ]
    nouns = [
        "flights",
        "weather",
        "calendar_event",
        "email",
        "invoice",
        "contact",
        "hotel",
        "stock_quote",
        "news",
        "route",
        "recipe",
        "ticket",
        "file",
        "order",
        "reminder",
        "currency",
        "note",
        "playlist",
        "review",
        "forecast",
    ]
    out = []
    for i in range(count):
        verb, noun = verbs[i % len(verbs)], nouns[i]
        props = {
            "query": {"type": "string", "description": f"What to {verb} among the {noun}."},
            "limit": {
                "type": "integer",
                "description": "Most results to return.",
                "minimum": 1,
                "maximum": 50,
            },
            "region": {
                "type": "string",
                "enum": ["eu", "us", "apac"],
                "description": f"Where the {noun} are kept.",
            },
        }
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"{verb}_{noun}",
                    "description": f"{verb.capitalize()} {noun.replace('_', ' ')} for the user; "
                    f"returns JSON with the matching {noun.replace('_', ' ')}.",
                    "parameters": {"type": "object", "properties": props, "required": ["query"]},
                },
            }
        )
    json.dumps(out)  # plain JSON, as a client would send
    return out
