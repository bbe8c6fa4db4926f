"""Chunk marks on SGLang's ``/generate`` and ``/v1/chat/completions``: parsing, validation,
HTTP 400.

A pure ASGI middleware in front of SGLang's FastAPI app rewrites a chunked request into a
plain SGLang request (``input_ids`` plus the marks in ``sampling_params.custom_params``)
before SGLang sees it; malformed marks are answered with 400 and a message, and never reach
the engine, so the server keeps serving.

Request forms (single requests; a batch with chunk marks is rejected):
  {"input_ids": [...], "pic": {"chunks": [[s, e], ...], "config": {...}}, ...}
  {"text": "q <d>chunk A<d> <d>chunk B<d> question", "pic": {"config": {...}}, ...}
  {"text": "... <d>chunk<d> ..."}            (the delimiter alone marks chunks)
``config`` holds per-request overrides of PicConfig (policy, daric_r, ...).

With a KV page size above 1, pad tokens are inserted into the fresh text before each chunk
so that every chunk starts on a page boundary (``pad_chunk_starts``); the ``input_ids`` sent
on, the spans and SGLang's prompt token count all include them, as they are prefilled.

OpenAI chat: a message with ``"pic_chunk": true``, or a text item of a content list with
``"pic_chunk": true``, is a chunk; ``"pic": {"config": {...}}`` carries overrides.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from sgl_pic.config import PicConfig
from sgl_pic.integration.spans import (
    check_overrides,
    encode,
    layout_from_spans,
    split_on_delimiter,
)
from sgl_pic.layout import LayoutError, PaddedPrompt, PromptLayout, pad_chunk_starts

PREFIX_NAMESPACE = "sgl_pic:"
GENERATE_PATH = "/generate"
CHAT_PATH = "/v1/chat/completions"


class RequestTranslator:
    """load_tokenizer() returns the model's HF tokenizer (``__call__`` and
    ``apply_chat_template``); it is loaded on first use."""

    def __init__(self, config: PicConfig, load_tokenizer: Callable[[], Any]) -> None:
        self.config = config
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def pad_id(self) -> int:
        """The token that pads chunk starts to a page boundary: the tokenizer's pad token,
        else its EOS token."""
        tok = self.tokenizer
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, name, None)
            if isinstance(value, int) and value >= 0:
                return value
        raise LayoutError(
            f"page size {self.config.page_size} needs a token to pad chunk starts with, but "
            "the tokenizer has neither a pad_token_id nor an eos_token_id"
        )

    def align(self, ids: list[int], layout: PromptLayout) -> PaddedPrompt:
        """``ids`` and ``layout`` with chunk starts padded to the KV page size; unchanged
        for a page size of 1 (which then needs no pad token)."""
        if self.config.page_size == 1:
            return PaddedPrompt(ids, layout)
        return pad_chunk_starts(ids, layout, self.config.page_size, self.pad_id())

    def tokenize(self, text: str, is_first: bool) -> list[int]:
        """Special tokens (e.g. BOS) only on the first piece of a prompt."""
        return list(self.tokenizer(text, add_special_tokens=is_first)["input_ids"])

    def chat(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """/v1/chat/completions: messages (or text items of a content list) marked with
        ``"pic_chunk": true`` become chunks. The chat template is rendered here with each
        chunk wrapped in delimiters, tokenized piecewise, and sent as SGLang's ``input_ids``
        (which bypasses its own templating) plus the marks in ``custom_params``."""
        messages = obj.get("messages")
        if not isinstance(messages, list) or not _has_chat_marks(messages):
            return None
        d = self.config.delimiter
        rendered_msgs = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise LayoutError(f"message {i} must be an object")
            content = msg.get("content")
            if isinstance(content, list):
                parts = []
                for j, item in enumerate(content):
                    if not (isinstance(item, dict) and item.get("type") == "text"):
                        raise LayoutError(
                            f"message {i} item {j}: only text items may stand beside chunks"
                        )
                    text = str(item.get("text", ""))
                    parts.append(d + text + d if item.get("pic_chunk") else text)
                text = "".join(parts)
            elif isinstance(content, str):
                text = d + content + d if msg.get("pic_chunk") else content
            else:
                raise LayoutError(f"message {i} has no text content")
            if d in (content if isinstance(content, str) else "") and not msg.get("pic_chunk"):
                raise LayoutError(f"message {i} contains the chunk delimiter {d!r}")
            rendered_msgs.append({"role": msg.get("role", "user"), "content": text})
        prompt = self.tokenizer.apply_chat_template(
            rendered_msgs, tokenize=False, add_generation_prompt=True
        )
        # The template already holds its special tokens as text.
        ids, layout = split_on_delimiter(
            prompt,
            d,
            lambda t, _first: list(self.tokenizer(t, add_special_tokens=False)["input_ids"]),
        )
        ids, layout = self.align(ids, layout)
        obj["messages"] = [_strip_marks(m) for m in messages]
        obj["input_ids"] = ids
        custom = dict(obj.get("custom_params") or {})
        custom.update(encode(layout, self._overrides(obj.pop("pic", None))))
        obj["custom_params"] = custom
        obj["extra_key"] = _namespaced(obj.get("extra_key"))
        return obj

    def _overrides(self, pic: Any) -> dict[str, Any]:
        if pic is None:
            return {}
        if not isinstance(pic, dict):
            raise LayoutError(f"'pic' must be an object, got {type(pic).__name__}")
        unknown = sorted(set(pic) - {"config"})
        if unknown:
            raise LayoutError(f"unknown field(s) {unknown} in 'pic'; allowed: config")
        return check_overrides(pic.get("config"), self.config)

    def generate(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The rewritten request, or None when it carries no chunk marks.
        Raises LayoutError for malformed marks."""
        pic = obj.pop("pic", None)
        text = obj.get("text")
        has_delim = isinstance(text, str) and self.config.delimiter in text
        if pic is None and not has_delim:
            return None
        if pic is None:
            pic = {}
        if not isinstance(pic, dict):
            raise LayoutError(f"'pic' must be an object, got {type(pic).__name__}")
        unknown = sorted(set(pic) - {"chunks", "config"})
        if unknown:
            raise LayoutError(f"unknown field(s) {unknown} in 'pic'; allowed: chunks, config")
        overrides = self._overrides({"config": pic.get("config")})
        ids, layout = self.align(*self._layout(obj, pic))
        obj.pop("text", None)
        obj["input_ids"] = ids
        sp = obj.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise LayoutError("chunk marks need a single request ('sampling_params' object)")
        custom = dict(sp.get("custom_params") or {})
        custom.update(encode(layout, overrides))
        obj["sampling_params"] = {**sp, "custom_params": custom}
        obj["extra_key"] = _namespaced(obj.get("extra_key"))
        return obj

    def _layout(self, obj: dict[str, Any], pic: dict[str, Any]) -> tuple[list[int], PromptLayout]:
        """The request's token ids and their validated chunk spans (not yet page-aligned)."""
        if "chunks" in pic:
            ids = obj.get("input_ids")
            if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
                raise LayoutError(
                    "'pic.chunks' needs 'input_ids' of one request (a non-empty list of ints)"
                )
            if obj.get("text") is not None:
                raise LayoutError("send either 'text' with delimiters or 'input_ids' with chunks")
            return ids, layout_from_spans(ids, pic["chunks"])
        text = obj.get("text")
        if not isinstance(text, str):
            raise LayoutError(
                "chunk marks need one 'text' string with delimiters, or 'input_ids' with "
                "'pic.chunks'"
            )
        return split_on_delimiter(text, self.config.delimiter, self.tokenize)


class PicHTTPMiddleware:
    """ASGI middleware applying ``RequestTranslator`` to POST /generate and chat."""

    def __init__(self, app: Any, translator: RequestTranslator) -> None:
        self.app = app
        self.translator = translator

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if not (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope.get("path") in (GENERATE_PATH, CHAT_PATH)
        ):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict):
                new = None
            elif scope["path"] == CHAT_PATH:
                new = self.translator.chat(obj)
            else:
                new = self.translator.generate(obj)
        except json.JSONDecodeError:
            new = None  # SGLang answers malformed JSON itself
        except LayoutError as e:
            await _send_json(send, 400, {"error": {"message": str(e), "code": 400}})
            return
        if new is not None:
            body = json.dumps(new).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_json(
    send: Callable[[dict[str, Any]], Awaitable[None]], status: int, payload: dict[str, Any]
) -> None:
    data = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _namespaced(extra_key: Any) -> str:
    """SGLang's prefix-tree namespace for chunked requests. Their KV is approximate past the
    recomputed tokens, and SGLang inserts it into the prefix tree under the token ids: in a
    namespace of its own it serves later chunked requests (hit-aware reuse) but never a
    plain request, which stays exact."""
    if extra_key is not None and not isinstance(extra_key, str):
        raise LayoutError("'extra_key' must be one string for a chunked request")
    return PREFIX_NAMESPACE + (extra_key or "")


def _has_chat_marks(messages: list[Any]) -> bool:
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        if msg.get("pic_chunk"):
            return True
        content = msg.get("content")
        if isinstance(content, list) and any(
            isinstance(item, dict) and item.get("pic_chunk") for item in content
        ):
            return True
    return False


def _strip_marks(msg: Any) -> Any:
    if not isinstance(msg, dict):
        return msg
    out = {k: v for k, v in msg.items() if k != "pic_chunk"}
    if isinstance(out.get("content"), list):
        out["content"] = [
            {k: v for k, v in item.items() if k != "pic_chunk"} if isinstance(item, dict) else item
            for item in out["content"]
        ]
    return out


def hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def install(config: PicConfig, tokenizer_path: str) -> None:
    """Puts the middleware in front of SGLang's HTTP app (call before the server starts)."""
    from sglang.srt.entrypoints.http_server import app

    app.add_middleware(
        PicHTTPMiddleware,
        translator=RequestTranslator(config, lambda: hf_tokenizer(tokenizer_path)),
    )
