"""Chunk marks on SGLang's HTTP API: parsing, validation, signing, HTTP 4xx.

A pure ASGI middleware in front of SGLang's FastAPI app checks every POST body and rewrites
a chunked request into a plain SGLang request (``input_ids`` plus signed marks in the
custom params) before SGLang sees it. What a client can get wrong is answered here with a
4xx and a message, so it never reaches the engine:

- any body: over ``max_body_mb`` (413), JSON nested deeper than ``max_json_depth`` (400),
  internal keys a client may not send (``sgl_pic_*`` custom params, an ``sgl_pic`` extra
  key) on any path (400);
- token ids outside the vocabulary, negative or not integers, in plain requests too
  (``/generate`` single and batch, ``/v1/completions`` token prompts) (400);
- malformed marks, overrides or limits (400);
- on /generate, /v1/completions and chat: text that is not valid Unicode (a lone UTF-16
  surrogate such as JSON's ``"\ud800"``, which the tokenizer cannot take), a
  ``stop_regex`` that does not compile, a ``rid`` that does not fit the request (a list
  for a single request, a batch's of another length) (400); SGLang alone answers these
  with a 500;
- ``pic`` on /v1/completions, which does not carry chunk marks (400).

The scheduler checks the same rules again where the work happens (``gate.py``); the edge
only gives clients a clear answer early. ``install`` also adds the operator's deletion
endpoint, POST /pic/delete (``delete_http``).

Request forms (single requests; a batch with chunk marks is refused):
  {"input_ids": [...], "pic": {"chunks": [[s, e], ...], "config": {...}}, ...}
  {"text": "q <d>chunk A<d> <d>chunk B<d> question", "pic": {"config": {...}}, ...}
  {"text": "... <d>chunk<d> ..."}            (the delimiter alone marks chunks)
``config`` holds per-request overrides of PicConfig (policy, daric_r, ...).

With a KV page size above 1, pad tokens are inserted into the fresh text before each chunk
so that every chunk starts on a page boundary (``pad_chunk_starts``); the ``input_ids`` sent
on, the spans and SGLang's prompt token count all include them, as they are prefilled.

OpenAI chat: a message with ``"pic_chunk": true``, or a text item of a content list with
``"pic_chunk": true``, is a chunk; with auto-chunking (``--pic-auto-chunk`` or
``"pic": {"auto_chunk": ...}``) tool results, documents and earlier turns are marked here,
and tool schemas become chunks too (``chat_chunks``); ``"pic": {"config": {...}}`` carries
overrides. The prompt is what the model's chat template renders, as SGLang's chat path
renders it (tools, tool choice and template options included: ``chat_render``), and chunks
are spans of that text (``template_spans``); a client's ``input_ids``, which replace the
template's prompt, are refused with client marks (400) and leave an auto-chunked request
to SGLang unchunked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sgl_pic.config import PicConfig
from sgl_pic.http.chat_chunks import (
    chat_options,
    chat_prompt,
    has_chat_marks,
)
from sgl_pic.http.chat_render import ChatTemplate, server_template_defaults
from sgl_pic.http.spans import (
    INTERNAL_PREFIX,
    MAC_KEY,
    LimitError,
    MarkSigner,
    SpecialTokens,
    check_limits,
    check_overrides,
    encode,
    layout_from_spans,
    special_tokens,
    split_on_delimiter,
)
from sgl_pic.layout import LayoutError, PaddedPrompt, PromptLayout, pad_chunk_starts

GENERATE_PATH = "/generate"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TRANSLATED_PATHS = (GENERATE_PATH, CHAT_PATH, COMPLETIONS_PATH)

# A lone UTF-16 surrogate: what json.loads makes of an unpaired "\ud800" escape (a pair
# becomes one code point). Not valid Unicode: it cannot be encoded as UTF-8 or tokenized.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Where one can stand in a body: an escape "\uD8xx".."\uDFxx", or the bytes of an encoded
# surrogate (json.loads decodes with surrogatepass). Bodies without either skip the walk.
_RAW_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# SGLang's own bounds on stop_regex (sampling_params.py, refused there with a 400); here they
# only bound the patterns compiled in the event loop.
_STOP_REGEX_MAX_CHARS = 256
_STOP_REGEX_MAX_COUNT = 32


class BodyTooLarge(Exception):
    """A request body over the size limit (HTTP 413)."""


class RequestTranslator:
    """load_tokenizer() returns the model's HF tokenizer (``__call__`` and
    ``apply_chat_template``); it is loaded on first use.
    signer:     signs the marks of every rewritten request (None: unsigned, which the
                scheduler does not honour; for tests of the rewrite alone).
    vocab_size: the model's vocabulary; token ids outside it are refused (None: unchecked
                here, the scheduler still checks).
    auto_chunk: roles whose chat messages are marked as chunks without a client mark
                (``chat_chunks``; empty: only on a request's ``pic.auto_chunk``).
    chat_refusal() is '' when SGLang's chat path renders with the tokenizer's Jinja
                template, else why chat requests are not chunked here
                (``chat_source.ChatSource.refusal``): marks get a 400, auto-chunking steps
                aside."""

    def __init__(
        self,
        config: PicConfig,
        load_tokenizer: Callable[[], Any],
        signer: MarkSigner | None = None,
        vocab_size: int | None = None,
        auto_chunk: frozenset[str] = frozenset(),
        chat_refusal: Callable[[], str] = lambda: "",
    ) -> None:
        self.config = config
        self.chat_refusal = chat_refusal
        self.signer = signer
        self.vocab_size = vocab_size
        self.auto_chunk = auto_chunk
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._specials: SpecialTokens | None = None

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

    def _tokenize(self, text: str, special: bool) -> list[int]:
        check_unicode(text, "a prompt text")
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def chunk_ids(self, text: str) -> list[int]:
        """A marked chunk's token ids, as ``generate`` tokenizes the text between two
        delimiters (on its own, no special tokens); raises LayoutError for text that is
        not valid Unicode."""
        return self._tokenize(text, False)

    @property
    def specials(self) -> SpecialTokens:
        """What the tokenizer adds around a whole prompt (e.g. BOS)."""
        if self._specials is None:
            self._specials = special_tokens(self._tokenize)
        return self._specials

    def check_ids(self, ids: Any, field: str) -> None:
        """Raises LayoutError unless ``ids`` is a non-empty list of token ids in the
        vocabulary (``field`` names it in the message)."""
        if not isinstance(ids, list) or not ids:
            raise LayoutError(f"'{field}' must be a non-empty list of token ids")
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise LayoutError(f"'{field}'[{i}] must be an integer token id, got {t!r}")
            if t < 0 or (self.vocab_size is not None and t >= self.vocab_size):
                raise LayoutError(
                    f"'{field}'[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})"
                )

    def check_id_lists(self, value: Any, field: str) -> None:
        """``value`` as a request's token ids: one list, or a batch of lists."""
        if isinstance(value, list) and value and isinstance(value[0], list):
            for b, ids in enumerate(value):
                self.check_ids(ids, f"{field}[{b}]")
        else:
            self.check_ids(value, field)

    def completions(self, obj: dict[str, Any]) -> None:
        """/v1/completions: a token-id prompt (one or a batch) is checked like input_ids;
        ``pic`` is refused (chunk marks go to /generate or chat)."""
        if "pic" in obj:
            raise LayoutError(
                "'pic' is not supported on /v1/completions, which takes no chunk marks (its "
                "prompt goes to the model as it is, delimiters included); send chunked prompts "
                "to /generate ('text' with delimiters, or 'input_ids' with 'pic.chunks') or to "
                "/v1/chat/completions"
            )
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            self.check_id_lists(prompt, "prompt")

    def chat(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """/v1/chat/completions: chunks marked by the client (``"pic_chunk": true`` on a
        message or a text item) or by auto-chunking, and tool schemas (``chat_chunks``). The
        request is rendered here as SGLang's chat path renders it (the model's template with
        tools and template options), tokenized piece by piece, and sent as SGLang's
        ``input_ids`` (which bypasses its own templating) plus the signed marks in
        ``custom_params``. None when the body passes on as it is."""
        pic = obj.get("pic")
        options = chat_options(pic, self.auto_chunk)
        overrides = check_overrides(options.config, self.config)
        roles = options.roles
        messages = obj.get("messages")
        refusal = self.chat_refusal()
        if refusal:
            if isinstance(messages, list) and has_chat_marks(messages):
                raise LayoutError(
                    f"chunk marks in chat requests are off on this server: {refusal}, which "
                    "the chunked prompt could not reproduce; send the request without marks"
                )
            roles = frozenset()  # auto-chunking steps aside: SGLang renders it
        if obj.get("input_ids") is not None:
            if isinstance(messages, list) and has_chat_marks(messages):
                raise LayoutError(
                    "'input_ids' cannot be combined with chunk marks ('pic_chunk'): they "
                    "replace the chat template's prompt that the marks are found in; send "
                    "the request without chunk marks"
                )
            # Auto-chunking steps aside: the client's ids are the prompt.
            roles = frozenset()
        prompt = chat_prompt(
            obj,
            roles,
            self.config,
            self._render_chat(),
            lambda t: self._tokenize(t, False),
            server_template_defaults(),
        )
        if isinstance(messages, list) and (prompt is not None or "pic" in obj):
            obj["messages"] = [_strip_marks(m) for m in messages]
        if prompt is None:
            if "pic" not in obj:
                return None
            if not ((isinstance(pic, dict) and "auto_chunk" in pic) or options.roles):
                raise LayoutError(
                    "'pic' needs at least one message marked with 'pic_chunk', or auto_chunk"
                )
            del obj["pic"]  # auto-chunking found nothing to mark: SGLang serves it as it is
            return obj
        obj.pop("pic", None)
        ids, layout = self.align(*prompt)
        check_limits(layout, self.config)
        self.check_ids(ids, "input_ids")
        obj["input_ids"] = ids
        custom = _custom_params(obj.get("custom_params"))
        custom.update(self._marks(ids, layout, overrides))
        obj["custom_params"] = custom
        return obj

    def _render_chat(self) -> ChatTemplate:
        """The model's chat template, rendered as SGLang's chat path renders it."""
        return ChatTemplate(self.tokenizer)

    def _overrides(self, pic: Any) -> dict[str, Any]:
        if pic is None:
            return {}
        if not isinstance(pic, dict):
            raise LayoutError(f"'pic' must be an object, got {type(pic).__name__}")
        unknown = sorted(set(pic) - {"config"})
        if unknown:
            raise LayoutError(f"unknown field(s) {unknown} in 'pic'; allowed: config")
        return check_overrides(pic.get("config"), self.config)

    def _marks(self, ids: list[int], layout: PromptLayout, overrides: dict[str, Any]) -> dict:
        marks = encode(layout, overrides)
        if self.signer is not None:
            marks[MAC_KEY] = self.signer.sign(ids, marks)
        return marks

    def generate(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The rewritten request, or None when it carries no chunk marks (its token ids
        checked all the same). Raises LayoutError for anything malformed."""
        pic = obj.pop("pic", None)
        text = obj.get("text")
        d = self.config.delimiter
        if isinstance(text, list) and any(isinstance(t, str) and d in t for t in text):
            raise LayoutError(
                f"a batch of texts cannot carry chunk marks ({d!r}); send each chunked prompt "
                "as its own request"
            )
        if obj.get("input_ids") is not None:
            self.check_id_lists(obj["input_ids"], "input_ids")
        has_delim = isinstance(text, str) and d in text
        if pic is None and not has_delim:
            return None
        if text is not None and obj.get("input_ids") is not None:
            raise LayoutError(
                "a chunked request takes either 'text' (with delimiters) or 'input_ids' (with "
                "'pic.chunks'), not both"
            )
        if pic is None:
            pic = {}
        if not isinstance(pic, dict):
            raise LayoutError(f"'pic' must be an object, got {type(pic).__name__}")
        unknown = sorted(set(pic) - {"chunks", "config"})
        if unknown:
            raise LayoutError(f"unknown field(s) {unknown} in 'pic'; allowed: chunks, config")
        overrides = self._overrides({"config": pic.get("config")})
        ids, layout = self.align(*self._layout(obj, pic))
        check_limits(layout, self.config)
        self.check_ids(ids, "input_ids")
        obj.pop("text", None)
        obj["input_ids"] = ids
        sp = obj.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise LayoutError("chunk marks need a single request ('sampling_params' object)")
        custom = _custom_params(sp.get("custom_params"))
        custom.update(self._marks(ids, layout, overrides))
        obj["sampling_params"] = {**sp, "custom_params": custom}
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
        marked = text.count(self.config.delimiter) // 2
        if marked > self.config.max_chunks:
            # Before tokenizing piece by piece, which runs in the server's event loop.
            raise LimitError(
                f"{marked} chunks marked; this server takes at most {self.config.max_chunks} "
                "per request (--pic-max-chunks)"
            )
        return split_on_delimiter(
            text, self.config.delimiter, lambda t: self._tokenize(t, False), self.specials
        )


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
        if _RAW_SURROGATE.search(body) or body.lstrip()[:1] not in (b"{", b"["):
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


def check_client_body(obj: Any, max_depth: int) -> None:
    """Raises LayoutError when a parsed body nests deeper than ``max_depth``, holds an
    internal key (``sgl_pic_*`` in any ``custom_params``, an ``sgl_pic`` extra key), or
    marks a chat chunk with anything but a boolean. Iterative: depth is what it bounds."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise LayoutError(f"JSON nested deeper than {max_depth} levels (--pic-max-json-depth)")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        custom = node.get("custom_params")
        if isinstance(custom, dict) and any(
            isinstance(k, str) and k.startswith(INTERNAL_PREFIX) for k in custom
        ):
            raise LayoutError(
                f"custom_params keys starting with {INTERNAL_PREFIX!r} are internal; send "
                "chunk marks as 'pic' or with the delimiter"
            )
        extra = node.get("extra_key")
        extras = extra if isinstance(extra, list) else [extra]
        if any(isinstance(e, str) and e.startswith(INTERNAL_PREFIX) for e in extras):
            raise LayoutError(f"extra_key values starting with {INTERNAL_PREFIX!r} are internal")
        if "pic_chunk" in node and not isinstance(node["pic_chunk"], bool):
            raise LayoutError(f"'pic_chunk' must be true or false, got {node['pic_chunk']!r}")
        stack.extend((v, depth + 1) for v in node.values())


def check_unicode(text: str, where: str) -> None:
    """Raises LayoutError when ``text`` holds a lone UTF-16 surrogate (not valid Unicode:
    it cannot be encoded as UTF-8, nor tokenized)."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise LayoutError(
            f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate "
            f"({m.group()!r} at character {m.start()}); send each surrogate in a pair, or the "
            "character itself as UTF-8"
        )


def check_body_text(obj: Any) -> None:
    """Raises LayoutError for the first string (key or value) of a parsed body holding a
    lone UTF-16 surrogate, naming where it stands (e.g. ``messages[1].content``)."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            check_unicode(node, f"'{where}'" if where else "the body")
        elif isinstance(node, list):
            stack.extend(
                (v, f"{where}[{i}]") for i, v in enumerate(node) if isinstance(v, (str, list, dict))
            )
        elif isinstance(node, dict):
            for k, v in node.items():
                key = f"{where}.{k}" if where else str(k)
                check_unicode(k, f"the key '{key}'")
                if isinstance(v, (str, list, dict)):
                    stack.append((v, key))


def check_generation_options(path: str, obj: dict[str, Any]) -> None:
    """Raises LayoutError for a ``stop_regex`` that is not a string or list of strings or
    does not compile, and for a ``rid`` that does not fit the request: a string for a single
    request (or a list of one with ``n`` > 1, which SGLang turns into a batch of one), a
    string or a list of one string per prompt for a batch. Checked on /generate, on
    /v1/completions and chat (``path``); SGLang answers these with a 500."""
    n: Any = obj.get("n", 1)
    if path == GENERATE_PATH:
        sp = obj.get("sampling_params")
        if isinstance(sp, list):
            for i, p in enumerate(sp):
                if isinstance(p, dict):
                    _check_stop_regex(p.get("stop_regex"), f"sampling_params[{i}].stop_regex")
            first = sp[0] if sp else None
        else:
            if isinstance(sp, dict):
                _check_stop_regex(sp.get("stop_regex"), "sampling_params.stop_regex")
            first = sp
        n = 1
        if isinstance(first, dict):
            beam = first.get("beam_width")
            n = 1 if type(beam) is int and beam > 1 else first.get("n", 1)
        batch = _generate_batch(obj)
    else:
        _check_stop_regex(obj.get("stop_regex"), "stop_regex")
        batch = _prompt_batch(obj.get("prompt")) if path == COMPLETIONS_PATH else 0
    if batch is not None:
        _check_rid(obj.get("rid"), batch, type(n) is int and n > 1)


def _check_stop_regex(value: Any, field: str) -> None:
    if value is None:
        return
    patterns = value if isinstance(value, list) else [value]
    if len(patterns) > _STOP_REGEX_MAX_COUNT:
        return  # SGLang refuses so many itself
    for i, p in enumerate(patterns):
        where = f"'{field}'[{i}]" if isinstance(value, list) else f"'{field}'"
        if not isinstance(p, str):
            raise LayoutError(
                f"{where} must be a regular expression string (a string or a list of strings), "
                f"got {type(p).__name__}"
            )
        if len(p) > _STOP_REGEX_MAX_CHARS:
            continue  # over SGLang's length limit: refused there
        try:
            re.compile(p)
        except (re.error, OverflowError, RecursionError) as e:
            raise LayoutError(f"{where} = {p!r} is not a valid regular expression: {e}") from e


def _generate_batch(obj: dict[str, Any]) -> int | None:
    """A /generate body's prompt count as SGLang reads it: 0 for a single request, the
    batch size for a batch, None when the body does not say (SGLang answers that)."""
    text = obj.get("text")
    if text is not None:
        return 0 if isinstance(text, str) else len(text) if isinstance(text, list) else None
    ids = obj.get("input_ids")
    if isinstance(ids, list):
        return len(ids) if ids and isinstance(ids[0], list) else 0
    return None


def _prompt_batch(prompt: Any) -> int | None:
    """The same for a /v1/completions prompt (text or token ids, one or a batch)."""
    if isinstance(prompt, str):
        return 0
    if isinstance(prompt, list) and prompt:
        return len(prompt) if isinstance(prompt[0], (str, list)) else 0
    return None


def _check_rid(rid: Any, batch: int, parallel: bool) -> None:
    """``batch``: 0 for a single request, else its prompt count; ``parallel``: n > 1."""
    if rid is None or isinstance(rid, str):
        return
    if not isinstance(rid, list):
        raise LayoutError(f"'rid' must be a string or a list of strings, got {type(rid).__name__}")
    for i, r in enumerate(rid):
        if not isinstance(r, str):
            raise LayoutError(f"'rid'[{i}] must be a string, got {type(r).__name__}")
    if batch == 0 and not parallel:
        raise LayoutError(
            "'rid' of a single request must be a string, got a list (a list gives one rid per "
            "prompt of a batch)"
        )
    expected = batch or 1
    if len(rid) != expected:
        raise LayoutError(
            f"'rid' lists {len(rid)} ids for {expected} prompt(s); send one per prompt, or a string"
        )


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


def _custom_params(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LayoutError(f"'custom_params' must be an object, got {type(value).__name__}")
    return dict(value)


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
