"""Turning an OpenAI chat request into chunks of the prompt the model's template renders.

``RequestTranslator.chat`` renders the request with the model's chat template exactly as
SGLang's chat path would (``chat_render``: messages, tools, ``tool_choice`` and template
options such as ``chat_template_kwargs``, ``reasoning_effort``, ``continue_final_message``),
finds the pieces in that text (``template_spans``), tokenizes each piece on its own and the
text between them as it stands, and sends SGLang ``input_ids``. This module decides the
pieces. The prompt text is the template's, byte for byte; only the tokenization differs
(at piece boundaries).

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
own tokenization at content-defined cut points (``sgl_pic.http.cut_points``): its text is
tokenized on its own, so its windows, and their cache keys, are the same wherever it
appears, whatever precedes it, and an edit inside it changes only the windows around the
edit.

Tool schemas: when chunks apply (a mark, or auto-chunking on), each tool the template shows
is a chunk made here (fresh when short), its text being the template's own serialisation of
it (``tojson``), which depends on that tool alone whatever the order or subset of tools. A
template that serialises tools otherwise leaves them fresh. SGLang keeps ``tools`` in the
request: given ``input_ids`` it renders no prompt from them and uses them to parse tool
calls and build tool-choice constraints, as for a request it rendered.

A piece the template does not render verbatim (trimmed, rewritten, repeated, dropped) stays
fresh; a client's mark on such a piece is an error (HTTP 400). Finding such pieces renders
the whole conversation again per try, so only pieces that can become chunks are searched
(the client's, the tools, the latest ``max_chunks`` long enough of those made here), within
``search_renders`` renderings; the pieces it does not reach stay fresh (a client's mark among
them is an error). A request auto-chunking cannot
render (a content item other than text, a template that fails) is left to SGLang unchunked;
with chunks the client marked, the same is an error. Malformed requests (bad ``pic``
options, messages or tools) are errors either way. A client's ``input_ids`` replace
SGLang's templating: refused with marks, left to SGLang under auto-chunking (the caller).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from itertools import pairwise
from typing import Any, NamedTuple

from sgl_pic.config import PicConfig
from sgl_pic.http.chat_render import ChatTemplate
from sgl_pic.http.cut_points import cut_points
from sgl_pic.http.spans import LimitError
from sgl_pic.http.template_spans import (
    holds_reserved,
    locate,
    sentinel,
    sentinel_piece,
    tokenize_spans,
    unmark,
)
from sgl_pic.layout import LayoutError, PromptLayout, Span

AUTO_CHUNK_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "document")
# ``"auto_chunk": true`` on a server without --pic-auto-chunk. Not the system prompt: it
# opens the prompt, where SGLang's prefix cache serves it without being a chunk.
DEFAULT_AUTO_CHUNK: frozenset[str] = frozenset({"tool", "document", "user", "assistant"})
DOCUMENT = "document"


class PieceKind(Enum):
    """How a piece of the rendered prompt is used."""

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
    body: dict[str, Any],
    roles: frozenset[str],
    config: PicConfig,
    template: ChatTemplate,
    tokenize: Callable[[str], list[int]],
    defaults: Mapping[str, Any] | None = None,
) -> ChatPrompt | None:
    """The chunked prompt of chat ``body``, or None when it gets no chunks (nothing marked
    and auto-chunking off, nothing found to mark, or a request auto-chunking cannot render:
    SGLang then serves it as it is).

    The prompt's text is ``template``'s rendering of the request as SGLang's chat path
    renders it (``chat_render``; ``defaults``: the server's default template options),
    byte for byte; the pieces are found in it (``template_spans``) and each tokenized on
    its own (``tokenize``: without special tokens). Raises LayoutError for anything
    malformed, and for marked pieces the template does not render verbatim."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    marked = has_chat_marks(messages)
    if not marked and not roles:
        return None
    if marked and (count := client_marks(messages)) > config.max_chunks:
        # Before rendering and tokenizing piece by piece (in the server's event loop).
        raise LimitError(
            f"{count} chunks marked; this server takes at most {config.max_chunks} "
            "per request (--pic-max-chunks)"
        )
    check_tools(body.get("tools"), body.get("tool_choice"))
    try:
        if holds_reserved(json.dumps([messages, body.get("tools")], ensure_ascii=False)):
            # Text that would read as markers in the marked rendering.
            raise _Unrenderable(
                "the request holds private-use code points U+E000..U+E006, which chunk "
                "rendering reserves"
            )
        plan = _plan(messages, roles)
    except _Unrenderable:
        if marked:
            raise
        return None
    defaults = defaults or {}
    real = template.inputs(_body(body, plan, frozenset()), defaults)
    try:
        text, tools = template.render(real)
    except Exception as e:  # noqa: BLE001 - a chat template is the model's code, any error
        if marked:
            raise LayoutError(f"the chat template failed on the request: {e}") from e
        return None  # SGLang answers it
    n = len(plan.pieces)
    kinds = [p.kind for p in plan.pieces] + [PieceKind.AUTO] * len(tools or ())
    every = frozenset(range(n))
    marked_inputs = template.inputs(_body(body, plan, every), defaults)
    prefix_piece = sentinel_piece(marked_inputs.prefix)

    def attempt(subset: frozenset[int]) -> str:
        # The inputs with every content marked, the others' sentinels put back: parsing
        # the request again for each try would cost as much as the rendering.
        rest = {k: plan.pieces[k].text for k in every - subset}
        inputs = (
            marked_inputs._replace(
                messages=unmark(marked_inputs.messages, rest),
                prefix=unmark(marked_inputs.prefix, rest),
            )
            if rest
            else marked_inputs
        )
        contents = {k: plan.pieces[k].text for k in subset if k < n}
        tool_pieces = {k - n: k for k in subset if k >= n}
        return template.render_marked(inputs, tools, tool_pieces, contents)

    wanted = [k for k in range(n + len(tools or ())) if k != prefix_piece]
    tokenize = _memo(tokenize)  # pieces counted for the search are tokenized again below
    spans, unsearched = locate(
        text,
        attempt,
        wanted,
        search=_searched(plan, n, len(tools or ()), prefix_piece, config, tokenize),
        max_renders=search_renders(config),
    )
    found = {s.piece for s in spans}
    missing = [
        k for k in wanted if k < n and plan.pieces[k].kind is PieceKind.MARKED and k not in found
    ]
    if late := [k for k in missing if k in unsearched]:
        raise LayoutError(
            f"message {plan.owners[late[0]]}: the chat template does not render every marked "
            "text verbatim, and finding which ones it does took more than "
            f"{search_renders(config)} renderings; mark fewer texts, or only texts the "
            "template renders as they are (not trimmed or rewritten)"
        )
    if missing:
        raise LayoutError(
            f"message {plan.owners[missing[0]]}: the chat template does not render its marked "
            "text verbatim (it drops, trims, repeats or rewrites it), so it cannot be a chunk"
        )
    ids, ranges = tokenize_spans(text, spans, tokenize)
    pieces = [(Span(*r), kinds[s.piece]) for s, r in zip(spans, ranges, strict=True)]
    if real.prefix:
        # continue_final_message: SGLang tokenizes the continued text on its own after
        # the rendering's tokens.
        tail = template.encode_prefix(real.prefix)
        if prefix_piece is not None and tail:
            pieces.append((Span(len(ids), len(ids) + len(tail)), kinds[prefix_piece]))
        ids += tail
    chunks = _chunk_spans(ids, pieces, config)
    if not chunks:
        return None
    return ChatPrompt(ids, PromptLayout(len(ids), tuple(chunks)))


def search_renders(config: PicConfig) -> int:
    """The most renderings spent finding which pieces a template renders verbatim when not
    all of them are (each renders the whole conversation, in the server's event loop)."""
    return 16 + config.max_chunks // 8


def _searched(
    plan: _Plan,
    n: int,
    n_tools: int,
    prefix_piece: int | None,
    config: PicConfig,
    tokenize: Callable[[str], list[int]],
) -> list[int]:
    """The pieces worth searching for when not all render verbatim, first first: those
    that can become chunks (``_chunk_spans``). The client's marks, then the tools, then the
    latest of the messages' pieces made here long enough to be chunks, at most
    ``max_chunks`` of each (past it the earliest made here stay fresh anyway). Pieces only
    tokenized on their own, or too short, stay fresh."""
    shortest = max(config.auto_chunk_min_tokens, config.min_chunk_tokens)
    marked = [k for k in range(n) if plan.pieces[k].kind is PieceKind.MARKED]
    tools = list(range(n, n + n_tools))[: config.max_chunks]
    auto: list[int] = []
    for k in reversed(range(n)):
        if len(auto) >= config.max_chunks:
            break
        piece = plan.pieces[k]
        if piece.kind is not PieceKind.AUTO or k == prefix_piece:
            continue
        # A token holds at least one byte: fewer bytes than ``shortest`` is too short.
        if (
            len(piece.text.encode("utf-8", "surrogatepass")) >= shortest
            and len(tokenize(piece.text)) >= shortest
        ):
            auto.append(k)
    return [k for k in marked + tools + auto if k != prefix_piece]


def _memo(tokenize: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    seen: dict[str, list[int]] = {}

    def cached(text: str) -> list[int]:
        if text not in seen:
            seen[text] = tokenize(text)
        return list(seen[text])

    return cached


class _Plan(NamedTuple):
    """The pieces of a request's messages. pieces: id -> piece; owners: id -> message
    index; slots: (message, item or None) -> piece id, for content put in as a piece."""

    pieces: list[Piece]
    owners: list[int]
    slots: dict[tuple[int, int | None], int]


def _plan(messages: list[Any], roles: frozenset[str]) -> _Plan:
    auto = bool(roles)
    last_user = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and _role(i, m) == "user"),
        default=-1,
    )
    plan = _Plan([], [], {})
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise LayoutError(f"message {i} must be an object")
        role = _role(i, msg)
        chosen = _auto_chosen(role, msg.get("name"), i < last_user, roles)
        for j, piece in _content(i, msg, auto, chosen):
            if piece is None:
                continue
            plan.slots[(i, j)] = len(plan.pieces)
            plan.pieces.append(piece)
            plan.owners.append(i)
    return plan


def _body(body: dict[str, Any], plan: _Plan, subset: frozenset[int]) -> dict[str, Any]:
    """``body`` as SGLang receives it (no chunk marks, no ``pic``), with the content of
    the pieces in ``subset`` replaced by their sentinels."""
    out = {k: v for k, v in body.items() if k != "pic"}
    messages = []
    for i, msg in enumerate(body["messages"]):
        msg = {k: v for k, v in msg.items() if k != "pic_chunk"}
        content = msg.get("content")
        if isinstance(content, list):
            items = []
            for j, item in enumerate(content):
                if isinstance(item, dict):
                    item = {k: v for k, v in item.items() if k != "pic_chunk"}
                    k = plan.slots.get((i, j))
                    if k in subset:
                        item["text"] = sentinel(k)
                items.append(item)
            msg["content"] = items
        elif (k := plan.slots.get((i, None))) in subset:
            msg["content"] = sentinel(k)
        messages.append(msg)
    out["messages"] = messages
    return out


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


def _content(
    i: int, msg: dict[str, Any], auto: bool, chosen: bool
) -> list[tuple[int | None, Piece | None]]:
    """Message ``i``'s content as (item index or None for string content, its piece or
    None when fresh)."""
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
            chosen = False  # items the client did not mark stay fresh
        else:
            item_marks = [mark] * len(texts)
        return [
            (j, _piece(i, t, m, auto, chosen and m is None))
            for j, (t, m) in enumerate(zip(texts, item_marks, strict=True))
        ]
    if content is None:
        return []
    if not isinstance(content, str):
        raise LayoutError(f"message {i}: 'content' must be a string, a list of text items or null")
    return [(None, _piece(i, content, mark, auto, chosen and mark is None))]


def _piece(i: int, text: str, mark: bool | None, auto: bool, chosen: bool) -> Piece | None:
    """A text's piece: the client's chunk, a chunk made here, tokenized on its own, or None
    (fresh: not auto-chunked, or empty)."""
    if mark and not text:
        raise LayoutError(f"message {i}: a marked chunk is empty")
    if mark:
        return Piece(text, PieceKind.MARKED)
    if not (auto and text):
        return None
    return Piece(text, PieceKind.AUTO if chosen else PieceKind.OWN)


def check_tools(tools: Any, tool_choice: Any) -> None:
    """Raises LayoutError for ``tools`` or ``tool_choice`` SGLang's request model refuses
    (with the field at fault; SGLang's own answer names none). What it accepts is rendered
    as it renders it (``chat_render``): a null description or parameters, any schema, any
    type, names used twice."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise LayoutError(
            "'tools' must be a list of {'type': 'function', 'function': {...}} objects, got "
            f"{type(tools).__name__}"
        )
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise LayoutError(f"tool {i} must be an object, got {type(tool).__name__}")
        if not isinstance(tool.get("type", "function"), str):
            raise LayoutError(f"tool {i}: 'type' must be a string")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise LayoutError(f"tool {i}: 'function' must be an object")
        name = fn.get("name")
        if not isinstance(name, str):
            raise LayoutError(f"tool {i}: 'function.name' must be a string")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise LayoutError(f"tool {i} ({name}): 'function.description' must be a string")
    if tool_choice is None or tool_choice in ("auto", "required", "none"):
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise LayoutError(
            "'tool_choice' must be 'auto', 'required', 'none' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )


def _chunk_spans(
    ids: Sequence[int], pieces: Sequence[tuple[Span, PieceKind]], config: PicConfig
) -> list[Span]:
    """The chunks among the pieces' spans (of the prompt ``ids``): marked ones as they are,
    those made here windowed, or left fresh when too short or past ``max_chunks`` (the
    earliest)."""
    shortest = max(config.auto_chunk_min_tokens, config.min_chunk_tokens)
    size = max(config.segment_tokens, shortest)
    chunks: list[tuple[Span, bool]] = []  # (span, made here)
    for span, kind in pieces:
        if kind is PieceKind.MARKED:
            chunks.append((span, False))
        elif kind is PieceKind.AUTO and span.length >= shortest:
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
