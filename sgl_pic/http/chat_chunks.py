"""Turning an OpenAI chat request into chunks of the prompt the model's template renders.

``RequestTranslator.chat`` renders the request with the model's chat template exactly as
SGLang's chat path would (``chat_render``: messages, tools, ``tool_choice`` and template
options such as ``chat_template_kwargs``, ``reasoning_effort``, ``continue_final_message``),
finds the pieces in that text (``template_spans``), tokenizes each piece on its own and the
text between them as it stands, and sends SGLang ``input_ids``. ``chat_pieces`` decides
the pieces; this module finds them and chooses the chunks among them. The prompt text is
the template's, byte for byte; only the tokenization differs (at piece boundaries).

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

import functools
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import pairwise
from typing import Any, NamedTuple

from sgl_pic.config import PicConfig
from sgl_pic.core.spans import LimitError
from sgl_pic.http.chat_options import AUTO_CHUNK_ROLES as AUTO_CHUNK_ROLES
from sgl_pic.http.chat_options import client_marks, has_chat_marks
from sgl_pic.http.chat_options import parse_roles as parse_roles
from sgl_pic.http.chat_pieces import (
    PieceKind,
    PiecePlan,
    Unrenderable,
    check_tools,
    marked_body,
    plan_pieces,
)
from sgl_pic.http.chat_render import ChatInputs, ChatTemplate
from sgl_pic.http.cut_points import cut_points
from sgl_pic.http.template_spans import (
    PieceSpan,
    holds_reserved,
    locate,
    sentinel_piece,
    tokenize_spans,
    unmark,
)
from sgl_pic.layout import LayoutError, PromptLayout, Span


class ChatPrompt(NamedTuple):
    """The rendered prompt's token ids and its chunk spans (not yet page-aligned)."""

    token_ids: list[int]
    layout: PromptLayout


class _Planned(NamedTuple):
    """A chat request that may get chunks: whether the client marked any, and its
    pieces (``plan_pieces``)."""

    marked: bool
    plan: PiecePlan


class _Rendered(NamedTuple):
    """The request rendered as SGLang renders it: its template inputs, the text and the
    tools the text was rendered with."""

    inputs: ChatInputs
    text: str
    tools: list[dict[str, Any]] | None


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
    planned = _plan(body, roles, config)
    if planned is None:
        return None
    marked, plan = planned
    defaults = defaults or {}
    rendered = _render(body, plan, marked, template, defaults)
    if rendered is None:
        return None  # SGLang answers it
    text, tools = rendered.text, rendered.tools
    n, n_tools = len(plan.pieces), len(tools or ())
    kinds = [p.kind for p in plan.pieces] + [PieceKind.AUTO] * n_tools
    marked_inputs = template.inputs(marked_body(body, plan, frozenset(range(n))), defaults)
    prefix_piece = sentinel_piece(marked_inputs.prefix)
    wanted = [k for k in range(n + n_tools) if k != prefix_piece]
    tokenize = _memo(tokenize)  # pieces counted for the search are tokenized again below
    spans, unsearched = locate(
        text,
        functools.partial(_attempt, template, plan, marked_inputs, tools),
        wanted,
        search=_searched(plan, n, n_tools, prefix_piece, config, tokenize),
        max_renders=search_renders(config),
    )
    _check_marked_found(plan, wanted, spans, unsearched, config)
    ids, pieces = _tokenized(text, spans, tokenize, kinds, template, rendered.inputs, prefix_piece)
    chunks = _chunk_spans(ids, pieces, config)
    if not chunks:
        return None
    return ChatPrompt(ids, PromptLayout(len(ids), tuple(chunks)))


def _plan(body: dict[str, Any], roles: frozenset[str], config: PicConfig) -> _Planned | None:
    """The pieces of chat ``body`` (``chat_prompt``'s first step), or None when it gets no
    chunks: no message list, nothing marked with auto-chunking off, or a request
    auto-chunking cannot render. Raises LimitError past ``max_chunks`` marks, LayoutError
    for malformed tools, and Unrenderable for marked requests that cannot be rendered."""
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
            raise Unrenderable(
                "the request holds private-use code points U+E000..U+E006, which chunk "
                "rendering reserves"
            )
        plan = plan_pieces(messages, roles)
    except Unrenderable:
        if marked:
            raise
        return None
    return _Planned(marked, plan)


def _render(
    body: dict[str, Any],
    plan: PiecePlan,
    marked: bool,
    template: ChatTemplate,
    defaults: Mapping[str, Any],
) -> _Rendered | None:
    """``body`` (its marks stripped by ``plan``) rendered as SGLang renders it, or None
    when the template fails on an unmarked request (SGLang answers it). Raises LayoutError
    for a body SGLang refuses, and when the template fails on a marked request."""
    real = template.inputs(marked_body(body, plan, frozenset()), defaults)
    try:
        text, tools = template.render(real)
    except Exception as e:  # noqa: BLE001 - a chat template is the model's code, any error
        if marked:
            raise LayoutError(f"the chat template failed on the request: {e}") from e
        return None
    return _Rendered(real, text, tools)


def _attempt(
    template: ChatTemplate,
    plan: PiecePlan,
    marked_inputs: ChatInputs,
    tools: list[dict[str, Any]] | None,
    subset: frozenset[int],
) -> str:
    """The marked rendering with only the pieces of ``subset`` marked (``locate``'s
    ``attempt``): piece ids below ``len(plan.pieces)`` are message texts, the others
    ``tools`` (by index past them). ``marked_inputs``: the inputs with every message text
    marked; the others' sentinels are put back here, since parsing the request again for
    each try would cost as much as the rendering."""
    n = len(plan.pieces)
    rest = {k: plan.pieces[k].text for k in frozenset(range(n)) - subset}
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


def _check_marked_found(
    plan: PiecePlan,
    wanted: Sequence[int],
    spans: Sequence[PieceSpan],
    unsearched: Collection[int],
    config: PicConfig,
) -> None:
    """Raises LayoutError when a piece the client marked (among ``wanted``) has no span
    in the rendering: the search did not reach it (``unsearched``), or the template does
    not render it verbatim."""
    n = len(plan.pieces)
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


class _Tokenized(NamedTuple):
    """The prompt's token ids and each found piece's token span with its kind."""

    ids: list[int]
    pieces: list[tuple[Span, PieceKind]]


def _tokenized(
    text: str,
    spans: Sequence[PieceSpan],
    tokenize: Callable[[str], list[int]],
    kinds: Sequence[PieceKind],
    template: ChatTemplate,
    real: ChatInputs,
    prefix_piece: int | None,
) -> _Tokenized:
    """``text`` tokenized with each of ``spans`` on its own (``tokenize_spans``), then the
    text ``continue_final_message`` continues (``real.prefix``), which SGLang tokenizes on
    its own after the rendering's tokens; that text is a piece of kind
    ``kinds[prefix_piece]`` when ``prefix_piece`` is not None."""
    ids, ranges = tokenize_spans(text, spans, tokenize)
    pieces = [(Span(*r), kinds[s.piece]) for s, r in zip(spans, ranges, strict=True)]
    if real.prefix:
        tail = template.encode_prefix(real.prefix)
        if prefix_piece is not None and tail:
            pieces.append((Span(len(ids), len(ids) + len(tail)), kinds[prefix_piece]))
        ids += tail
    return _Tokenized(ids, pieces)


def search_renders(config: PicConfig) -> int:
    """The most renderings spent finding which pieces a template renders verbatim when not
    all of them are (each renders the whole conversation, in the server's event loop)."""
    return 16 + config.max_chunks // 8


def _searched(
    plan: PiecePlan,
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
