"""A chat request rendered as SGLang's chat path renders it, and marked for chunk spans.

``chat_inputs`` builds what SGLang's Jinja chat path (``OpenAIServingChat._process_messages``
and ``_apply_jinja_template`` in srt/entrypoints/openai/serving_chat.py) hands the
tokenizer's ``apply_chat_template``: the request parsed by SGLang's own
``ChatCompletionRequest``, messages dumped and normalised by SGLang's helpers (tool-call
arguments decoded, content lists flattened for string-content templates, tool results
joined, tool results reordered where the template may reorder them, a final assistant
message turned into a user turn, or cut off as the prefix ``continue_final_message``
continues), the tools the template shows under ``tool_choice``, and the template options
(``reasoning_effort``, ``chat_template_kwargs`` over the server's defaults).

``ChatTemplate`` renders them with the model's tokenizer, as SGLang does (retrying with
function-only tools where the template fails on OpenAI's wrapper, as SGLang does), and
renders the same inputs marked (``template_spans``).

What the HTTP edge cannot see and so cannot reproduce: a server launched with a named
conversation template (``--chat-template NAME``), a Python chat encoder (DeepSeek V3.2,
Kimi K3, Harmony) or a model-specific effort setting; with those, chunked chat requests are
not rendered as SGLang renders them (the README lists it).

Called on the HTTP server's side.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

from sgl_pic.http.template_spans import (
    Marks,
    marking_template,
    render_marked,
    render_sentinels,
)
from sgl_pic.layout import LayoutError


class ChatInputs(NamedTuple):
    """What SGLang passes to ``apply_chat_template`` for one request. prefix: the final
    assistant text ``continue_final_message`` continues (SGLang tokenizes it on its own and
    appends it to the rendering's tokens), else None."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    add_generation_prompt: bool
    prefix: str | None


def chat_inputs(
    body: Mapping[str, Any], content_format: str, defaults: Mapping[str, Any]
) -> ChatInputs:
    """SGLang's template inputs for chat ``body`` (chunk marks already stripped).
    content_format: SGLang's detected format of the template ("string" or "openai");
    defaults: the server's ``--default-chat-template-kwargs``. Raises LayoutError for a
    body SGLang refuses."""
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    try:
        request = ChatCompletionRequest(**body)
    except (ValidationError, ValueError, TypeError) as e:
        raise LayoutError(f"invalid chat request: {e}") from e
    kwargs = _template_kwargs(request.chat_template_kwargs, request.reasoning_effort, defaults)
    tools = _shown_tools(request)
    rendered = _template_messages(request, content_format)
    add_generation_prompt = request._format_add_generation_prompt
    final = _final_turn(rendered, add_generation_prompt, request.continue_final_message)
    return ChatInputs(
        final.messages, tools, kwargs, add_generation_prompt is not False, final.prefix
    )


def _template_kwargs(
    request_kwargs: Mapping[str, Any] | None, effort: Any, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The template options SGLang passes for a request with ``chat_template_kwargs``
    ``request_kwargs`` and ``reasoning_effort`` ``effort``, over the server's ``defaults``.

    SGLang takes ``reasoning_effort`` out of the request's template options (over the
    request's own field) before it merges the server's defaults into them
    (``_convert_to_internal_request``, then ``_process_messages``): a default
    ``reasoning_effort`` then wins over the request's (it is set again from them)."""
    ctk = dict(request_kwargs or {})
    own = ctk.pop("reasoning_effort", None)
    if own is not None:
        effort = own
    for k, v in (defaults or {}).items():  # None reads as no defaults
        ctk.setdefault(k, v)
    if effort is None:
        effort = ctk.get("reasoning_effort")
    kwargs: dict[str, Any] = {} if effort is None else {"reasoning_effort": effort}
    kwargs.update(ctk)
    return kwargs


def _shown_tools(request: Any) -> list[dict[str, Any]] | None:
    """The tools the template shows for SGLang's parsed ``request`` under its
    ``tool_choice``: none for "none" (or no tools anywhere), the named one for a named
    choice, else all of the request's."""
    if not _effective_tools(request) or request.tool_choice == "none":
        return None
    if not isinstance(request.tool_choice, str):
        name = request.tool_choice.function.name
        tools = [t.model_dump() for t in request.tools or [] if t.function.name == name]
        return tools or None
    if request.tools:
        return [t.model_dump() for t in request.tools]
    return None


def _template_messages(request: Any, content_format: str) -> list[dict[str, Any]]:
    """SGLang's parsed ``request``'s messages as its chat path hands them to the template:
    dumped, tool-call arguments decoded, null content made "", content shaped for
    ``content_format`` and tool results joined. Raises LayoutError for tool-call
    arguments SGLang refuses."""
    from sglang.srt.parser.jinja_template_utils import process_content_for_template_format

    messages = [m.model_dump() for m in request.messages]
    for m in messages:
        decode_tool_call_arguments(m)
    # SGLang reorders a run of tool results for templates that pair them with calls by id
    # only where the run holds media (or for MiniMax M3): never for the text-only messages
    # rendered here (``chat_chunks`` leaves media to SGLang).
    rendered = []
    for m in copy.deepcopy(messages):
        if m.get("content") is None:
            m["content"] = ""
        out = process_content_for_template_format(m, content_format, [], [], [], [])
        out["content"] = join_tool_content(out["role"], out.get("content"))
        rendered.append(out)
    return rendered


class _FinalTurn(NamedTuple):
    """The messages the template renders and the text ``continue_final_message``
    continues (None: none)."""

    messages: list[dict[str, Any]]
    prefix: str | None


def _final_turn(
    rendered: list[dict[str, Any]],
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
) -> _FinalTurn:
    """``rendered`` with a final assistant text handled as SGLang does: cut off as the
    prefix under ``continue_final_message``, else made a user turn when the request set
    no ``add_generation_prompt``; other messages unchanged (``rendered`` is not
    modified)."""
    if (add_generation_prompt is None or continue_final_message) and rendered:
        last = rendered[-1]
        if last.get("role") == "assistant" and isinstance(last.get("content"), str):
            if continue_final_message:
                return _FinalTurn(rendered[:-1], last["content"])
            return _FinalTurn([*rendered[:-1], {"role": "user", "content": last["content"]}], None)
    return _FinalTurn(rendered, None)


def decode_tool_call_arguments(message: dict[str, Any]) -> None:
    """An assistant message's tool-call arguments decoded from JSON in place, as SGLang's
    ``normalize_assistant_tool_call_arguments`` (strict) does; raises LayoutError where
    SGLang refuses them (not JSON, or not an object)."""
    import orjson

    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return
    for item in calls:
        fn = item.get("function") if isinstance(item, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("arguments"), str)):
            continue
        try:
            args = orjson.loads(fn["arguments"])
        except orjson.JSONDecodeError as e:
            raise LayoutError("Assistant tool call function.arguments must be valid JSON.") from e
        if not isinstance(args, dict):
            raise LayoutError("Assistant tool call function.arguments must be a JSON object.")
        fn["arguments"] = args


def join_tool_content(role: str, content: Any) -> Any:
    """A tool result's content list of text parts joined by spaces, as SGLang's
    ``normalize_tool_content`` does (other content unchanged)."""
    if role != "tool" or not isinstance(content, list):
        return content
    if all(
        (isinstance(p, dict) and p.get("type") == "text") or isinstance(p, str) for p in content
    ):
        return " ".join(p.get("text", "") if isinstance(p, dict) else p for p in content)
    return content


def _effective_tools(request: Any) -> list[Any]:
    """The request's tools and those of its system/developer messages (SGLang's
    ``_effective_tools``)."""
    tools = list(request.tools or [])
    for m in request.messages:
        if getattr(m, "role", None) in ("root", "system", "developer") and getattr(
            m, "tools", None
        ):
            tools.extend(m.tools)
    return tools


@functools.lru_cache(maxsize=16)
def _content_format(template: str) -> str:
    """SGLang's reading of whether ``template`` takes content as a string or as OpenAI's
    list (``TemplateManager`` reads it once per server; cached here by template text)."""
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format

    return detect_jinja_template_content_format(template)


def flat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function-only tools: SGLang's second try for templates that fail on the wrapper."""
    return [t.get("function", t) for t in tools] if tools else None


class ChatTemplate:
    """The model's chat template, through its HF tokenizer (``apply_chat_template``), as
    SGLang's chat path uses it. Stateless besides the tokenizer; safe to share."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def template(self) -> str | None:
        """The tokenizer's own template text (None: it renders without one)."""
        t = getattr(self.tokenizer, "chat_template", None)
        return t if isinstance(t, str) else None

    def inputs(self, body: Mapping[str, Any], defaults: Mapping[str, Any]) -> ChatInputs:
        """``chat_inputs`` of ``body`` for this template."""
        template = self.template
        content_format = "string" if template is None else _content_format(template)
        return chat_inputs(body, content_format, defaults)

    def render(self, inputs: ChatInputs) -> tuple[str, list[dict[str, Any]] | None]:
        """The rendering SGLang tokenizes and the tools it was rendered with (SGLang retries
        with function-only tools where the template fails on OpenAI's wrapper). Raises what
        the template raises."""
        try:
            return self._apply(inputs, inputs.tools), inputs.tools
        except Exception:  # noqa: BLE001 - as SGLang, any template error gets the second try
            tools = flat_tools(inputs.tools)
            return self._apply(inputs, tools), tools

    def _apply(self, inputs: ChatInputs, tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(
            inputs.messages,
            tokenize=False,
            add_generation_prompt=inputs.add_generation_prompt,
            tools=tools,
            return_dict=False,
            **inputs.kwargs,
        )

    def encode_prefix(self, text: str) -> list[int]:
        """``continue_final_message``'s text as SGLang appends it: encoded on its own, a
        leading BOS dropped."""
        ids = list(self.tokenizer(text)["input_ids"])
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return ids[1:] if ids and bos is not None and ids[0] == bos else ids

    def render_marked(
        self,
        inputs: ChatInputs,
        tools: list[dict[str, Any]] | None,
        tool_pieces: Mapping[int, int],
        contents: Mapping[int, str],
    ) -> str:
        """The marked rendering (``template_spans``) of ``inputs`` whose contents hold the
        sentinels of ``contents`` (piece id -> real text); ``tool_pieces``: index in
        ``tools`` -> piece id of the tools to mark. Mirrors ``apply_chat_template``'s
        inputs: messages without null fields, plain data, reasoning aliases, the
        tokenizer's special tokens as variables. A tokenizer without a Jinja template is
        rendered itself, with contents marked and tools not."""
        if self.template is None and inputs.kwargs.get("chat_template") is None:
            return render_sentinels(self._apply(inputs, tools), contents)
        from transformers.utils import chat_template_utils as ctu

        source = self.tokenizer.get_chat_template(inputs.kwargs.get("chat_template"), tools)
        template = marking_template(source, ctu._compile_jinja_template)
        # transformers >= 5.24 prepares the template's inputs (null fields dropped, plain
        # data, reasoning aliases); 5.19, SGLang 0.5.23's, passes them as given. Each step is
        # taken where the installed transformers takes it, so the rendering stays its own.
        normalize = getattr(ctu, "_normalize_chat_messages", _as_given)
        plain = getattr(ctu, "_plain_template_data", _as_given)
        alias = getattr(ctu, "_alias_reasoning_fields", _as_given)
        messages = alias(plain(normalize(inputs.messages)))
        plain_tools = plain(tools)
        objects: dict[int, int] = {}
        for i, piece in tool_pieces.items():
            tool = plain_tools[i]
            objects[id(tool)] = piece
            if isinstance(tool.get("function"), dict):
                objects[id(tool["function"])] = piece
        kwargs = {k: v for k, v in inputs.kwargs.items() if k != "chat_template"}
        variables = {
            **plain({**self.tokenizer.special_tokens_map, **kwargs}),
            "messages": messages,
            "tools": plain_tools,
            "documents": None,
            "add_generation_prompt": inputs.add_generation_prompt,
        }
        return render_marked(template, variables, Marks(contents, objects))


def _as_given(value: Any) -> Any:
    return value


def server_template_defaults() -> dict[str, Any]:
    """The server's ``--default-chat-template-kwargs`` as SGLang's chat path reads them
    (empty outside a server, where SGLang has published no serving settings)."""
    try:
        from sglang.srt.runtime_context import get_serving

        return dict(get_serving().default_chat_template_kwargs or {})
    except (ImportError, ValueError):
        return {}
