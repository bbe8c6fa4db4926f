"""A chat request's chunking options: the ``pic`` object of its body (auto-chunking
roles, per-request overrides), ``--pic-auto-chunk``'s roles, and the chunks the client
marked itself (``"pic_chunk": true`` on a message or a text item). Pure functions of the
body, in the server's HTTP process; malformed options raise ``LayoutError`` (a 400).

Auto-chunking roles (``chat_chunks`` says what each marks): ``tool``, ``document``,
``system``, ``developer``, ``user``, ``assistant``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sgl_pic.layout import LayoutError

AUTO_CHUNK_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "document")
# ``"auto_chunk": true`` on a server without --pic-auto-chunk. Not the system prompt: it
# opens the prompt, where SGLang's prefix cache serves it without being a chunk.
DEFAULT_AUTO_CHUNK: frozenset[str] = frozenset({"tool", "document", "user", "assistant"})


class ChatOptions(NamedTuple):
    """The chat body's ``pic`` object. roles: auto-chunking roles in force for this
    request (empty: off); config: the per-request overrides as sent (checked by the
    caller)."""

    roles: frozenset[str]
    config: Any


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
