"""Turning an OpenAI chat request into delimited messages: which text becomes a chunk.

``RequestTranslator.chat`` renders the model's chat template itself, with chunk text wrapped
in delimiters, tokenizes the prompt piecewise (``split_on_delimiter``: each delimited piece
on its own) and sends SGLang ``input_ids``. This module decides the pieces.

Chunks a client marks (``"pic_chunk": true`` on a message or on a text item) are taken as
sent; ``"pic_chunk": false`` keeps a message out of auto-chunking. Auto-chunking
(``--pic-auto-chunk ROLES``, or ``"pic": {"auto_chunk": true | false | [roles]}`` per
request) marks chunks itself, chosen by these names:

- ``tool``: every tool result (role "tool"), wherever it stands;
- ``document``: every message whose ``name`` is "document" (any role), wherever it stands.
  A field rather than a role: SGLang's OpenAI layer refuses roles outside the standard
  ones, and other servers ignore ``name``;
- ``system``, ``developer``, ``user``, ``assistant``: earlier turns, the messages of that
  role before the last user message (the last one is the question, fresh text).

With auto-chunking on, every message text is tokenized on its own whether it becomes a chunk
or not, so a turn's tokens stay a prefix of the next turn's (where the question has become
an earlier turn) and SGLang's prefix cache serves them as device prefix. A text shorter than
``auto_chunk_min_tokens`` (or ``min_chunk_tokens``) stays fresh: reuse would recompute most
of it; past ``max_chunks``, the earliest chunks made here stay fresh. A chunk made here that
is longer than ``segment_tokens`` is split into windows of at most that many tokens of its
own tokenization at content-defined cut points (``sgl_pic.cut_points``): its text is
tokenized on its own, so its windows, and their cache keys, are the same wherever it
appears, whatever precedes it, and an edit inside it changes only the windows around the
edit.

Tool schemas: when chunks apply (a mark, or auto-chunking on) and the request carries
``tools``, each tool the template would show (all, none for ``tool_choice: "none"``, the
named one for a named choice) is rendered as canonical JSON (sorted keys) on its own line,
one chunk each (one shorter than ``auto_chunk_min_tokens`` stays fresh, as any such text),
after a fixed header, at the end of the first system message (a system message is added in
front when the first message is not one). Its tokens depend on that tool alone, whatever
the order or subset of tools. The chat template never sees ``tools``.
SGLang keeps them in the request: given ``input_ids`` it renders no prompt from them and
only uses them to parse tool calls and build tool-choice constraints.

A request auto-chunking cannot render (a content item other than text, text containing the
delimiter, a template that fails or does not render message text verbatim) is left to SGLang
unchunked; with chunks the client marked, the same is an error (HTTP 400). Malformed
requests (bad ``pic`` options, messages or tools) are errors either way.

The prompt is the one SGLang's own chat path would render, apart from the piecewise
tokenization: a final assistant message is rendered as a user turn holding its text, as
SGLang does without ``continue_final_message``. Options that change SGLang's templating
(``TEMPLATE_OPTIONS``, and ``input_ids``, which replaces it) are not applied here: the caller
refuses them with chunks the client marked and leaves auto-chunked requests to SGLang.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from enum import Enum
from itertools import pairwise
from typing import Any, NamedTuple

from sgl_pic.config import PicConfig
from sgl_pic.cut_points import cut_points
from sgl_pic.integration.spans import LimitError, split_on_delimiter
from sgl_pic.layout import LayoutError, PromptLayout, Span

AUTO_CHUNK_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "document")
# ``"auto_chunk": true`` on a server without --pic-auto-chunk. Not the system prompt: it
# opens the prompt, where SGLang's prefix cache serves it without being a chunk.
DEFAULT_AUTO_CHUNK: frozenset[str] = frozenset({"tool", "document", "user", "assistant"})
DOCUMENT = "document"
# Chat request fields SGLang's own templating reads (the rendering here does not): a request
# carrying any of them is left to SGLang, or refused with client marks (``template_options``).
TEMPLATE_OPTIONS: tuple[str, ...] = (
    "continue_final_message",
    "chat_template_kwargs",
    "reasoning_effort",
    "reasoning",
    "thinking",
    "task",
)
TOOLS_HEADER = "You can call these functions; each line is one function's JSON schema:\n"


class PieceKind(Enum):
    """How a delimited piece of the rendered prompt is used."""

    MARKED = "marked"  # the client's chunk: one chunk, as sent
    AUTO = "auto"  # a chunk made here: windowed; fresh when too short or over the limit
    OWN = "own"  # tokenized on its own, but fresh


class Piece(NamedTuple):
    text: str
    kind: PieceKind


class ChatOptions(NamedTuple):
    """The chat body's ``pic`` object. roles: auto-chunking roles in force for this
    request (empty: off); config: the per-request overrides as sent (checked by the
    caller)."""

    roles: frozenset[str]
    config: Any


class ChatPrompt(NamedTuple):
    """The rendered prompt's token ids and its chunk spans (not yet page-aligned)."""

    token_ids: list[int]
    layout: PromptLayout


class _Unrenderable(LayoutError):
    """Valid chat content that cannot carry chunk marks: an error for marked requests,
    plain SGLang for auto-chunked ones."""


# A message's content as rendered: fresh text, and pieces wrapped in delimiters.
_Segments = list[str | Piece]
# What SGLang puts between the text items of a message's content list for a template that
# takes content as a string (``process_content_for_template_format``), the embedded
# model's among them.
ITEM_SEPARATOR = " "


def parse_roles(value: str) -> frozenset[str]:
    """The roles of ``--pic-auto-chunk`` (a comma list; '' is off). Raises ValueError for
    an empty item or a name outside ``AUTO_CHUNK_ROLES``."""
    if not value.strip():
        return frozenset()
    roles = [r.strip() for r in value.split(",")]
    for r in roles:
        if r not in AUTO_CHUNK_ROLES:
            raise ValueError(
                f"auto_chunk: {r!r} is not a role auto-chunking knows; use a comma list of "
                f"{', '.join(AUTO_CHUNK_ROLES)} ('' turns it off)"
            )
    return frozenset(roles)


def chat_options(pic: Any, server_roles: frozenset[str]) -> ChatOptions:
    """The validated ``pic`` object of a chat body (None: absent). ``auto_chunk``: true
    takes the server's roles (``DEFAULT_AUTO_CHUNK`` where the server has none), false
    turns auto-chunking off, a list names the roles; absent keeps the server's."""
    if pic is None:
        return ChatOptions(server_roles, None)
    if not isinstance(pic, dict):
        raise LayoutError(f"'pic' must be an object, got {type(pic).__name__}")
    unknown = sorted(set(pic) - {"config", "auto_chunk"})
    if unknown:
        raise LayoutError(f"unknown field(s) {unknown} in 'pic'; allowed: auto_chunk, config")
    if "auto_chunk" not in pic:
        return ChatOptions(server_roles, pic.get("config"))
    value = pic["auto_chunk"]
    if value is True:
        roles = server_roles or DEFAULT_AUTO_CHUNK
    elif value is False:
        roles = frozenset()
    elif isinstance(value, list):
        for i, r in enumerate(value):
            if r not in AUTO_CHUNK_ROLES:
                raise LayoutError(
                    f"'pic.auto_chunk'[{i}] = {r!r} is not a role auto-chunking knows; "
                    f"allowed: {', '.join(AUTO_CHUNK_ROLES)}"
                )
        roles = frozenset(value)
    else:
        raise LayoutError(
            "'pic.auto_chunk' must be true, false or a list of roles "
            f"({', '.join(AUTO_CHUNK_ROLES)}), got {value!r}"
        )
    return ChatOptions(roles, pic.get("config"))


def template_options(body: dict[str, Any]) -> list[str]:
    """The ``TEMPLATE_OPTIONS`` a chat body sets (absent, null, false or {} sets none)."""
    return [
        k
        for k in TEMPLATE_OPTIONS
        if not (body.get(k) is None or body.get(k) is False or body.get(k) == {})
    ]


def has_chat_marks(messages: Sequence[Any]) -> bool:
    """Whether the client marked a message or a text item with ``"pic_chunk": true``."""
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        if msg.get("pic_chunk") is True:
            return True
        content = msg.get("content")
        if isinstance(content, list) and any(
            isinstance(item, dict) and item.get("pic_chunk") is True for item in content
        ):
            return True
    return False


def client_marks(messages: Sequence[Any]) -> int:
    """How many messages and text items the client marked with ``"pic_chunk": true``."""
    count = 0
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        count += msg.get("pic_chunk") is True
        content = msg.get("content")
        if isinstance(content, list):
            count += sum(isinstance(i, dict) and i.get("pic_chunk") is True for i in content)
    return count


def chat_prompt(
    messages: Any,
    tools: Any,
    tool_choice: Any,
    roles: frozenset[str],
    config: PicConfig,
    render: Callable[[list[dict[str, Any]]], str],
    tokenize: Callable[[str], list[int]],
    string_content: bool = True,
) -> ChatPrompt | None:
    """The chunked prompt of a chat request, or None when it gets no chunks (nothing marked
    and auto-chunking off, or auto-chunking found nothing to mark or cannot render it:
    SGLang then serves it as it is).

    ``render(messages)`` is the chat template (text, with the generation prompt);
    ``tokenize(text)`` tokenizes without special tokens; ``string_content``: whether the
    template takes content as a string (content lists are rendered only for such). Raises
    LayoutError for anything malformed, and for marked requests the template cannot carry
    (see the module doc)."""
    if not isinstance(messages, list):
        return None
    marked = has_chat_marks(messages)
    if not marked and not roles:
        return None
    if marked and (count := client_marks(messages)) > config.max_chunks:
        # Before rendering and tokenizing piece by piece (in the server's event loop).
        raise LimitError(
            f"{count} chunks marked; this server takes at most {config.max_chunks} per "
            "request (--pic-max-chunks)"
        )
    d = config.delimiter
    try:
        chat = _delimited_messages(messages, tools, tool_choice, roles, d, string_content)
        prompt = _template(render, chat, d)
    except _Unrenderable:
        if marked:
            raise
        return None
    # The template already holds its special tokens as text.
    ids, layout = split_on_delimiter(prompt, d, tokenize)
    spans = _chunk_spans(ids, layout.chunks, chat.pieces, config)
    if not spans:
        return None
    return ChatPrompt(ids, PromptLayout(len(ids), tuple(spans)))


class _DelimitedChat(NamedTuple):
    """The messages the template renders (chunk text wrapped in delimiters), and the
    delimited pieces in prompt order."""

    messages: list[dict[str, Any]]
    pieces: list[Piece]


def _delimited_messages(
    messages: list[Any],
    tools: Any,
    tool_choice: Any,
    roles: frozenset[str],
    d: str,
    string_content: bool = True,
) -> _DelimitedChat:
    auto = bool(roles)
    last_user = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and _role(i, m) == "user"),
        default=-1,
    )
    rendered: list[dict[str, Any]] = []
    contents: list[_Segments] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise LayoutError(f"message {i} must be an object")
        role = _role(i, msg)
        if msg.get("tools"):
            raise _Unrenderable(
                f"message {i} carries tools, which only SGLang's templating renders"
            )
        if isinstance(msg.get("content"), list) and not string_content:
            raise _Unrenderable(
                f"message {i}: this model's chat template reads content lists itself, which "
                "only SGLang's templating renders (send the content as a string)"
            )
        chosen = _auto_chosen(role, msg.get("name"), i < last_user, roles)
        contents.append(_content(i, msg, auto, chosen, d))
        rendered.append(_template_message(role, msg))
    if rendered and rendered[-1]["role"] == "assistant":
        # SGLang's chat path (without continue_final_message) renders a final assistant
        # message with string content as a user turn holding its text alone; a content list
        # it keeps or flattens depending on the template, which is not known here.
        if isinstance(messages[-1].get("content"), list):
            raise _Unrenderable(
                f"message {len(messages) - 1}: a final assistant message with a content list "
                "cannot be rendered with chunks (send its content as a string)"
            )
        rendered[-1] = {"role": "user"}
    shown = tool_texts(tools, tool_choice)
    if shown:
        segs: _Segments = [TOOLS_HEADER]
        for text in shown:
            if d in text:
                raise _Unrenderable(f"a tool schema contains the chunk delimiter {d!r}")
            segs += [Piece(text, PieceKind.AUTO), "\n"]
        if rendered and rendered[0]["role"] == "system":
            has_text = any(isinstance(s, Piece) or s for s in contents[0])
            contents[0] += ["\n\n", *segs] if has_text else segs
        else:
            rendered.insert(0, {"role": "system"})
            contents.insert(0, segs)
    pieces: list[Piece] = []
    for msg, segs in zip(rendered, contents, strict=True):
        msg["content"] = "".join(s if isinstance(s, str) else d + s.text + d for s in segs)
        pieces += [s for s in segs if isinstance(s, Piece)]
    return _DelimitedChat(rendered, pieces)


def _template(render: Callable[[list[dict[str, Any]]], str], chat: _DelimitedChat, d: str) -> str:
    """The rendered prompt, checked to hold every piece verbatim between delimiters."""
    try:
        prompt = render(chat.messages)
    except Exception as e:  # noqa: BLE001 - a chat template is the model's code, any error
        raise _Unrenderable(f"the chat template failed on the chunked messages: {e}") from e
    if prompt.split(d)[1::2] != [p.text for p in chat.pieces]:
        raise _Unrenderable(
            "the chat template does not render the message text verbatim (it drops, trims "
            "or rewrites some), so chunks cannot be marked in it"
        )
    return prompt


def _role(i: int, msg: dict[str, Any]) -> str:
    role = msg.get("role", "user")
    if not isinstance(role, str):
        raise LayoutError(f"message {i}: 'role' must be a string")
    return role.lower()  # as SGLang's OpenAI layer reads it


def _auto_chosen(role: str, name: Any, earlier: bool, roles: frozenset[str]) -> bool:
    """Whether auto-chunking makes this message a chunk (``earlier``: it stands before
    the last user message)."""
    if role == "tool" and "tool" in roles:
        return True
    if name == DOCUMENT and DOCUMENT in roles:
        return True
    return earlier and role in roles


def _content(i: int, msg: dict[str, Any], auto: bool, chosen: bool, d: str) -> _Segments:
    """Message ``i``'s content as fresh text and delimited pieces."""
    mark = msg.get("pic_chunk")
    if mark is not None and not isinstance(mark, bool):
        raise LayoutError(f"message {i}: 'pic_chunk' must be true or false, got {mark!r}")
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for j, item in enumerate(content):
            if not (isinstance(item, dict) and item.get("type") == "text"):
                raise _Unrenderable(
                    f"message {i} item {j}: only text items can be rendered with chunks"
                )
            text = item.get("text")
            if not isinstance(text, str):
                raise LayoutError(f"message {i} item {j}: 'text' must be a string")
            if d in text:
                raise _Unrenderable(f"message {i} item {j} contains the chunk delimiter {d!r}")
            texts.append(text)
        item_marks = [item.get("pic_chunk") for item in content]
        if any(m is not None for m in item_marks):
            if mark is not None:
                raise LayoutError(
                    f"message {i}: mark either the message or its items with 'pic_chunk'"
                )
            for j, m in enumerate(item_marks):
                if m is not None and not isinstance(m, bool):
                    raise LayoutError(
                        f"message {i} item {j}: 'pic_chunk' must be true or false, got {m!r}"
                    )
            segs: _Segments = []
            for j, (t, m) in enumerate(zip(texts, item_marks, strict=True)):
                if j:
                    segs.append(ITEM_SEPARATOR)
                segs.append(
                    Piece(t, PieceKind.MARKED)
                    if m
                    else Piece(t, PieceKind.OWN)
                    if auto and t
                    else t
                )
            return segs
        text = ITEM_SEPARATOR.join(texts)
    elif content is None:
        text = ""  # as SGLang renders a message without content (an assistant's tool call)
    elif isinstance(content, str):
        text = content
        if d in text:
            raise _Unrenderable(f"message {i} contains the chunk delimiter {d!r}")
    else:
        raise LayoutError(f"message {i}: 'content' must be a string, a list of text items or null")
    if mark:
        return [Piece(text, PieceKind.MARKED)]
    if not (auto and text):
        return [text]
    return [Piece(text, PieceKind.AUTO if chosen and mark is None else PieceKind.OWN)]


def _template_message(role: str, msg: dict[str, Any]) -> dict[str, Any]:
    """What the chat template sees of a message besides its content, as SGLang passes it:
    tool calls with JSON arguments decoded, the tool call id, the name (SGLang's user
    messages carry none) and an assistant's reasoning (templates of reasoning models
    render it), each only when not null."""
    out: dict[str, Any] = {"role": role}
    calls = msg.get("tool_calls")
    if calls is not None:
        out["tool_calls"] = [_decoded_call(c) for c in calls] if isinstance(calls, list) else calls
    for key in ("tool_call_id", "name", "reasoning_content"):
        if msg.get(key) is not None and not (key == "name" and role == "user"):
            out[key] = msg[key]
    return out


def _decoded_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("arguments"), str)):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call  # left as sent: templates print a string as it is
    return {**call, "function": {**fn, "arguments": args}}


def tool_texts(tools: Any, tool_choice: Any) -> list[str]:
    """Canonical JSON of each tool the prompt shows (validated). The prompt holds
    ``TOOLS_HEADER`` and then each of them on its own line."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise LayoutError(
            "'tools' must be a list of {'type': 'function', 'function': {...}} objects, got "
            f"{type(tools).__name__}"
        )
    canonical: list[tuple[str, str]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise LayoutError(f"tool {i} must be an object, got {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise LayoutError(f"tool {i}: only 'function' tools are supported, got {kind!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise LayoutError(f"tool {i}: 'function' must be an object")
        name = fn.get("name")
        if not (isinstance(name, str) and name):
            raise LayoutError(f"tool {i}: 'function.name' must be a non-empty string")
        if not isinstance(fn.get("description", ""), str):
            raise LayoutError(f"tool {i} ({name}): 'function.description' must be a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise LayoutError(
                f"tool {i} ({name}): 'function.parameters' must be a JSON schema object"
            )
        if any(name == n for n, _ in canonical):
            raise LayoutError(f"tool {i}: the name {name!r} is used by another tool")
        # Sorted keys: the same schema gives the same text, hence the same chunk tokens.
        text = json.dumps(
            {"type": "function", "function": fn},
            sort_keys=True,
            ensure_ascii=False,
            separators=(", ", ": "),
        )
        canonical.append((name, text))
    shown = _shown_tool(tool_choice)
    if shown is None:
        return [text for _, text in canonical]
    return [text for name, text in canonical if name == shown]


def _shown_tool(tool_choice: Any) -> str | None:
    """The tool names the prompt shows under ``tool_choice``, as SGLang's templating picks
    them: None for all, '' for none, else the one named."""
    if tool_choice is None or tool_choice in ("auto", "required"):
        return None
    if tool_choice == "none":
        return ""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise LayoutError(
            "'tool_choice' must be 'auto', 'required', 'none' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    return name


def _chunk_spans(
    ids: Sequence[int], spans: Sequence[Span], pieces: Sequence[Piece], config: PicConfig
) -> list[Span]:
    """The chunks among the delimited pieces' spans (of the prompt ``ids``): marked ones as
    they are, those made here windowed, or left fresh when too short or past
    ``max_chunks`` (the earliest)."""
    shortest = max(config.auto_chunk_min_tokens, config.min_chunk_tokens)
    size = max(config.segment_tokens, shortest)
    chunks: list[tuple[Span, bool]] = []  # (span, made here)
    for span, piece in zip(spans, pieces, strict=True):
        if piece.kind is PieceKind.MARKED:
            chunks.append((span, False))
        elif piece.kind is PieceKind.AUTO and span.length >= shortest:
            own = ids[span.start : span.end]
            chunks += [(w, True) for w in windows(span, own, size, shortest)]
    excess = len(chunks) - config.max_chunks
    kept = []
    for span, made_here in chunks:
        if made_here and excess > 0:
            excess -= 1
            continue
        kept.append(span)
    return kept


def windows(span: Span, token_ids: Sequence[int], size: int, min_tokens: int) -> list[Span]:
    """``span`` (holding ``token_ids``) cut into windows of at most ``size`` tokens at
    content-defined cut points (``cut_points``)."""
    bounds = [span.start] + [span.start + c for c in cut_points(token_ids, size, min_tokens)]
    return [Span(s, e) for s, e in pairwise(bounds)]
