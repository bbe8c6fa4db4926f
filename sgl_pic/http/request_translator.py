"""Chunk marks on SGLang's request bodies, turned into plain SGLang requests: a
chunked /generate or chat body becomes ``input_ids`` plus signed marks in the custom
params; malformed marks, overrides or limits, and ``pic`` on /v1/completions (which does
not carry chunk marks), raise ``LayoutError`` (a 400 at the edge). Runs in the server's
HTTP process; the scheduler checks the signed marks again (``core.gate``).

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

from collections.abc import Callable
from typing import Any

from sgl_pic.config import PicConfig
from sgl_pic.core.spans import (
    MAC_KEY,
    LimitError,
    MarkSigner,
    check_limits,
    check_overrides,
    encode,
    layout_from_spans,
    split_on_delimiter,
)
from sgl_pic.http.chat_chunks import chat_prompt
from sgl_pic.http.chat_options import chat_options, has_chat_marks
from sgl_pic.http.chat_render import ChatTemplate, server_template_defaults
from sgl_pic.http.prompt_tokens import PromptTokens
from sgl_pic.layout import LayoutError, PromptLayout


class RequestTranslator(PromptTokens):
    """Rewrites the bodies of /generate and chat with chunk marks into plain SGLang
    requests, and checks /v1/completions. Tokenizing and id checks are ``PromptTokens``'
    (its ``load_tokenizer()`` also gives ``apply_chat_template`` here).
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
        super().__init__(config, load_tokenizer, vocab_size)
        self.chat_refusal = chat_refusal
        self.signer = signer
        self.auto_chunk = auto_chunk

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
