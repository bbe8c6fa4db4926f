"""What the soak sends (``bench/soak.py``): prompts over a Zipf-popular passage pool, the
policies and their settings, chat bodies (marked chunks; auto-chunked tool results and
documents with tool schemas), long prompts and malformed requests.

Everything is tokenized up front, so client threads never share the (not thread-safe)
fast tokenizer; only the tenant probe tokenizes later, on its one thread.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, NamedTuple

POLICIES = ("full_recompute", "full_reuse", "epic", "cacheblend", "daric", "cachetune")
APPROXIMATE = POLICIES[1:]
VOCAB = 49152  # the embedded SmolLM2's vocabulary
# A tool schema chat requests carry (the template renders it; no call is expected).
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
MALFORMED_FORMS = (
    "overlap",
    "out_of_range",
    "too_short",
    "unknown_policy",
    "bool_setting",
    "n_avg_zero",
    "nan_budget",
    "pic_chunk_yes",
    "out_of_vocab",
    "internal_custom_params",
    "internal_extra_key",
    "unbalanced",
    "batch_delimiter",
    "deep_json",
)


class Passage(NamedTuple):
    text: str  # as truncated
    ids: list[int]  # PASSAGE_TEMPLATE-formatted, tokenized on its own


class Workload:
    """Prompts over ``pool`` passages of at most ``passage_tokens`` tokens, drawn with Zipf
    popularity ``zipf``; questions from the same examples."""

    def __init__(self, data: Path, pool: int, passage_tokens: int, zipf: float, seed: int) -> None:
        from _common import embedded_tokenizer

        from sgl_pic.prompts import (
            PASSAGE_TEMPLATE,
            QUESTION_TEMPLATE,
            SYSTEM_TEXT,
            load_rag_examples,
            truncate_tokens,
        )

        tok = embedded_tokenizer()

        def ids(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        # The tenant probe and the fault probes tokenize their fresh chunks with it.
        self.ids = ids
        examples = load_rag_examples(data)
        rng = random.Random(seed)
        texts = [p for ex in examples for p in ex.passages]
        rng.shuffle(texts)  # popularity independent of the file's order
        self.passages: list[Passage] = []
        for t in texts[:pool]:
            cut = truncate_tokens(tok, t, passage_tokens)
            self.passages.append(Passage(cut, ids(PASSAGE_TEMPLATE.format(text=cut))))
        self.weights = [1.0 / (rank + 1) ** zipf for rank in range(len(self.passages))]
        self.questions = [ex.question for ex in examples]
        self.tails = [ids(QUESTION_TEMPLATE.format(question=q)) for q in self.questions]
        self.system = ids(SYSTEM_TEXT)
        self.passage_template = PASSAGE_TEMPLATE
        # The canary: system, the two most popular passages, the first question, so the
        # chunked traffic touches exactly its tokens most often.
        self.canary_ids, self.canary_spans = self.compose([0, 1], 0)

    def draw(self, rng: random.Random, k: int | None = None) -> tuple[list[int], int]:
        """``k`` (default 2-6) distinct passages by popularity, and a question."""
        k = min(k or rng.randint(2, 6), len(self.passages))
        chosen: list[int] = []
        while len(chosen) < k:
            i = rng.choices(range(len(self.passages)), weights=self.weights)[0]
            if i not in chosen:
                chosen.append(i)
        return chosen, rng.randrange(len(self.questions))

    def passages_over(self, tokens: int) -> int:
        """How many passages a prompt needs to be longer than ``tokens`` tokens."""
        mean = sum(len(p.ids) for p in self.passages) / len(self.passages)
        return min(len(self.passages), math.ceil(tokens / mean) + 1)

    def compose(self, chosen: list[int], q: int) -> tuple[list[int], list[list[int]]]:
        """Ids and chunk spans: the system chunk, one chunk per passage, the question."""
        out = list(self.system)
        spans = [[0, len(out)]]
        for i in chosen:
            p = self.passages[i].ids
            spans.append([len(out), len(out) + len(p)])
            out += p
        return out + self.tails[q], spans

    def marked_chat(self, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
        """A chat body with ``pic_chunk`` on whole messages or on content items."""
        chosen, q = self.draw(rng)
        docs = [self.passage_template.format(text=self.passages[i].text) for i in chosen]
        question = "Question: " + self.questions[q]
        if rng.random() < 0.5:
            sub = "messages"
            messages: list[dict[str, Any]] = [
                *({"role": "user", "content": d, "pic_chunk": True} for d in docs),
                {"role": "user", "content": question},
            ]
        else:
            sub = "items"
            items = [{"type": "text", "text": d, "pic_chunk": True} for d in docs]
            items.append({"type": "text", "text": question})
            messages = [{"role": "user", "content": items}]
        return sub, {"model": "default", "messages": messages, "max_tokens": max_tokens}

    def tool_chat(self, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
        """A chat body with no marks: passages as tool results and messages named
        'document', a tool schema; the server's (or the request's) auto-chunking marks
        them. Half the requests name the roles themselves (``pic.auto_chunk``)."""
        chosen, q = self.draw(rng)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
        for n, i in enumerate(chosen):
            text = self.passages[i].text
            if n % 2:
                messages.append({"role": "user", "name": "document", "content": text})
                continue
            call = {"id": f"c{n}", "type": "function"}
            call["function"] = {"name": "search", "arguments": json.dumps({"query": str(i)})}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"c{n}", "content": text})
        messages.append({"role": "user", "content": self.questions[q]})
        body: dict[str, Any] = {
            "model": "default",
            "messages": messages,
            "tools": [SEARCH_TOOL],
            "max_tokens": max_tokens,
        }
        if rng.random() < 0.5:
            body["pic"] = {"auto_chunk": ["tool", "document"]}
            return "request_roles", body
        return "server_roles", body


def random_config(rng: random.Random, policy: str) -> dict[str, Any]:
    """The policy, and half the time valid settings of it (small, so requests stay short)."""
    config: dict[str, Any] = {"policy": policy}
    if rng.random() < 0.5:
        if policy == "epic":
            config["epic_k"] = rng.randint(0, 64)
        elif policy == "cacheblend":
            config["cacheblend_ratio"] = round(rng.uniform(0.05, 1.0), 3)
        elif policy == "daric":
            config.update(daric_r=round(rng.uniform(0.02, 1.0), 3), daric_n_avg=rng.randint(1, 64))
            config["daric_mtaf"] = rng.choice(["linear", "log", "exp"])
        elif policy == "cachetune":
            config["cachetune_r"] = round(rng.uniform(0.05, 1.0), 3)
    return config


def malformed(w: Workload, rng: random.Random, n: int) -> tuple[str, str, bytes]:
    """(form, path, body) of a request the server must refuse with 400 (oversized bodies
    are left to tests/integration/test_fuzz.py: they would measure the network)."""
    chosen, q = w.draw(rng)
    ids, spans = w.compose(chosen, q)
    sp = {"temperature": 0, "max_new_tokens": n}
    form = rng.choice(MALFORMED_FORMS)
    gen: dict[str, Any] = {"input_ids": ids, "pic": {"chunks": spans}, "sampling_params": sp}
    path, body = "/generate", gen
    text = w.passages[chosen[0]].text
    if form == "overlap":
        gen["pic"]["chunks"] = [*spans, [spans[1][0] + 1, spans[1][1] + 1]]
    elif form == "out_of_range":
        gen["pic"]["chunks"] = [*spans, [len(ids) - 2, len(ids) + 5]]
    elif form == "too_short":
        gen["pic"]["chunks"] = [[0, 2]]
    elif form == "unknown_policy":
        gen["pic"]["config"] = {"policy": "nope"}
    elif form == "bool_setting":
        gen["pic"]["config"] = {"policy": "epic", "epic_k": True}
    elif form == "n_avg_zero":
        gen["pic"]["config"] = {"policy": "daric", "daric_n_avg": 0}
    elif form == "nan_budget":
        gen["pic"]["config"] = {"policy": "daric", "daric_n_avg": math.nan}
    elif form == "pic_chunk_yes":
        path = "/v1/chat/completions"
        body = {
            "model": "default",
            "max_tokens": n,
            "messages": [
                {"role": "user", "content": text, "pic_chunk": "yes"},
                {"role": "user", "content": w.questions[q]},
            ],
        }
    elif form == "out_of_vocab":
        body = {"input_ids": [*ids[:-1], VOCAB + rng.randint(0, 10**6)], "sampling_params": sp}
    elif form == "internal_custom_params":
        sp = {**sp, "custom_params": {"sgl_pic_chunks": [0, 8], "sgl_pic_num_tokens": len(ids)}}
        body = {"input_ids": ids, "sampling_params": sp}
    elif form == "internal_extra_key":
        body = {"input_ids": ids, "sampling_params": sp, "extra_key": "sgl_pic:"}
    elif form == "unbalanced":
        body = {"text": "<|pic_chunk|>" + text, "sampling_params": sp}
    elif form == "batch_delimiter":
        body = {"text": ["<|pic_chunk|>" + text + "<|pic_chunk|> Q?", w.questions[q]]}
        body["sampling_params"] = sp
    else:
        return form, path, b'{"text": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    return form, path, json.dumps(body, allow_nan=True).encode()
