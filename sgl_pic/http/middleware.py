"""The HTTP edge's ASGI middleware, in front of SGLang's FastAPI app, and its install.

Every POST or PUT body is read whole (over ``max_body_mb``: 413) and parsed; a body a
client got wrong gets a 400 with a message, so it never reaches the engine:
``body_checks`` (depth, internal keys, Unicode, ``stop_regex``, ``rid``) on any path or
on the translated routes; ``RequestTranslator`` (``request_translator``) rewrites a
chunked request on /generate and chat into a plain SGLang request (``input_ids`` plus
signed marks in the custom params) and checks /v1/completions. The scheduler checks the
same rules again where the work happens (``core.gate``); the edge only gives clients
a clear answer early. ``install`` also adds the operator's deletion endpoint,
POST /pic/delete (``delete_route``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sgl_pic.core.spans import MarkSigner
from sgl_pic.http.body_checks import (
    check_body_text,
    check_client_body,
    check_generation_options,
    has_raw_surrogate,
)
from sgl_pic.http.request_translator import RequestTranslator as RequestTranslator
from sgl_pic.http.routes import CHAT_PATH as CHAT_PATH
from sgl_pic.http.routes import COMPLETIONS_PATH, GENERATE_PATH, TRANSLATED_PATHS
from sgl_pic.layout import LayoutError


class BodyTooLarge(Exception):
    """A request body over the size limit (HTTP 413)."""


class PicHTTPMiddleware:
    """ASGI middleware: body limits and internal-key checks on every POST, then
    ``RequestTranslator`` on /generate, /v1/completions and chat.

    max_body_bytes: largest body accepted (413 past it); max_json_depth: deepest nesting."""

    def __init__(
        self,
        app: Any,
        translator: RequestTranslator,
        max_body_bytes: int = 64 << 20,
        max_json_depth: int = 64,
    ) -> None:
        self.app = app
        self.translator = translator
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if not (scope["type"] == "http" and scope.get("method") in ("POST", "PUT")):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
        except BodyTooLarge:
            await _send_error(
                send, 413, f"request body over {self.max_body_bytes} bytes (--pic-max-body-mb)"
            )
            return
        try:
            new = self._check(scope, body)
        except LayoutError as e:
            await _send_error(send, 400, str(e))
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

    async def _read_body(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> bytes:
        """The whole body; raises BodyTooLarge as soon as it is known to be over the limit."""
        for k, v in scope["headers"]:
            if k.lower() == b"content-length" and v.isdigit() and int(v) > self.max_body_bytes:
                raise BodyTooLarge
        chunks, size = [], 0
        while True:
            msg = await receive()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def _check(self, scope: dict[str, Any], body: bytes) -> dict[str, Any] | None:
        """The rewritten request, or None to pass the body on as it is; raises LayoutError
        for a body a client must be told about."""
        try:
            # Every body that SGLang's own parsing (``json.loads`` of the bytes) would
            # accept, a byte-order mark or a UTF-16/32 encoding included: a body that this
            # check skipped but SGLang read would pass unchecked.
            obj = json.loads(body)
        except RecursionError as e:
            raise LayoutError(f"JSON nested deeper than {self.max_json_depth} levels") from e
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # SGLang answers malformed JSON itself
        check_client_body(obj, self.max_json_depth)
        if not isinstance(obj, dict):
            return None
        path = scope.get("path")
        if path not in TRANSLATED_PATHS:
            return None
        if has_raw_surrogate(body) or body.lstrip()[:1] not in (b"{", b"["):
            # The byte pattern reads plain UTF-8 only: a body with a byte-order mark or in
            # UTF-16/32 gets the walk.
            check_body_text(obj)
        check_generation_options(path, obj)
        if path == CHAT_PATH:
            return self.translator.chat(obj)
        if path == GENERATE_PATH:
            return self.translator.generate(obj)
        if path == COMPLETIONS_PATH:
            self.translator.completions(obj)
        return None


async def _send_error(
    send: Callable[[dict[str, Any]], Awaitable[None]], status: int, message: str
) -> None:
    data = json.dumps({"error": {"message": message, "code": status}}).encode()
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


def hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def model_vocab_size(model_path: str) -> int | None:
    """The model's vocabulary size from its config.json (None when it cannot be read: the
    scheduler's gate still checks every id)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for source in (cfg, cfg.get("text_config") or {}):
        value = source.get("vocab_size")
        if type(value) is int and value > 0:
            return value
    return None


def install(settings: Any, tokenizer_path: str, serving: Any = None) -> None:
    """Puts the middleware in front of SGLang's HTTP app (call before the server starts).
    ``settings`` is the launch's PicServerSettings (config, secret, body limits);
    ``serving``: the SGLang flags that decide how its chat path renders
    (``chat_source.ServingFlags``; None: none given)."""
    from sglang.srt.entrypoints.http_server import app

    from sgl_pic.http import delete_route as delete_http
    from sgl_pic.http.chat_source import ChatSource

    source = ChatSource(serving, settings.model_path, lambda: hf_tokenizer(tokenizer_path))
    signer = MarkSigner(settings.secret)
    translator = RequestTranslator(
        settings.config,
        source.tokenizer,
        signer=signer,
        vocab_size=model_vocab_size(settings.model_path),
        auto_chunk=settings.auto_chunk_roles,
        chat_refusal=source.refusal,
    )
    delete_http.install(app, translator, signer, settings.config.segment_tokens)
    app.add_middleware(
        PicHTTPMiddleware,
        translator=translator,
        max_body_bytes=settings.max_body_mb << 20,
        max_json_depth=settings.max_json_depth,
    )
