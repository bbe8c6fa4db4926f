"""The pieces of a chat request: which texts of its messages become chunks (the client's
marks, auto-chunking's choices), which are only tokenized on their own, and which stay
fresh; and the body with chosen pieces replaced by the sentinels that ``template_spans``
finds in a rendering. Also the check of ``tools`` and ``tool_choice`` as SGLang's request
model reads them. Pure functions of the body, in the server's HTTP process; malformed
messages or tools raise ``LayoutError`` (a 400), content that cannot carry marks
``Unrenderable``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

from sgl_pic.http.template_spans import sentinel
from sgl_pic.layout import LayoutError

DOCUMENT = "document"


class PieceKind(Enum):
    """How a piece of the rendered prompt is used."""

    MARKED = "marked"  # the client's chunk: one chunk, as sent
    AUTO = "auto"  # a chunk made here: windowed; fresh when too short or over the limit
    OWN = "own"  # tokenized on its own, but fresh


class Piece(NamedTuple):
    text: str
    kind: PieceKind


class Unrenderable(LayoutError):
    """Valid chat content that cannot carry chunk marks: an error for marked requests,
    plain SGLang for auto-chunked ones."""


class PiecePlan(NamedTuple):
    """The pieces of a request's messages. pieces: id -> piece; owners: id -> message
    index; slots: (message, item or None) -> piece id, for content put in as a piece."""

    pieces: list[Piece]
    owners: list[int]
    slots: dict[tuple[int, int | None], int]


def plan_pieces(messages: list[Any], roles: frozenset[str]) -> PiecePlan:
    """The pieces of ``messages`` under auto-chunking ``roles`` (empty: off, only the
    client's marks). Raises LayoutError for a malformed message, Unrenderable for
    content that cannot carry marks."""
    auto = bool(roles)
    last_user = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and _role(i, m) == "user"),
        default=-1,
    )
    plan = PiecePlan([], [], {})
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


def marked_body(body: dict[str, Any], plan: PiecePlan, subset: frozenset[int]) -> dict[str, Any]:
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
                raise Unrenderable(
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
