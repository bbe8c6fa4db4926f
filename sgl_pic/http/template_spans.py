"""Where each chunkable piece of a chat request lands in the model's own rendering.

The prompt of a chunked chat request is the chat template's rendering, byte for byte (what
SGLang's chat path renders). Chunks are spans of that text: a message's content (or a text
item of it) and a tool's schema as the template serialises it. To find them whatever the
template, the template is rendered a second time, *marked*:

- every piece of content is replaced by a sentinel string (private-use code points a
  client's text does not hold); in the output it is put back as the real text between
  markers, or, where the template passed it through ``tojson``, as its JSON-escaped text;
- the template's ``tojson`` filter wraps the serialisation of each tool object (the tool or
  its ``function`` object, found by identity at any depth, e.g. inside ``tools | tojson``)
  in markers.

Markers removed, the marked rendering must equal the real one exactly; the markers then give
each piece's span. Where it does not (the template trims, rewrites or repeats a piece, or
branches on its text), the pieces that could become chunks are searched by bisection, within
a bounded number of renderings (each renders the whole conversation: a piece-by-piece
search would take time quadratic in the message count), and only those keeping the
rendering exact are kept; the others stay fresh text. A template that serialises tools without
``tojson`` (key by key) leaves its tools fresh. Correctness never depends on this search:
the text is always the real rendering.

Called on the HTTP server's side, once per chat request with chunks (``chat_chunks``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jinja2

# Private-use code points: content sentinels and the markers of the marked rendering.
_SENT_OPEN, _SENT_CLOSE = "\ue000", "\ue001"
_MARK_OPEN, _MARK_MID, _MARK_CLOSE = "\ue002", "\ue003", "\ue004"
_HOLE_OPEN, _HOLE_CLOSE = "\ue005", "\ue006"
RESERVED = frozenset(
    _SENT_OPEN + _SENT_CLOSE + _MARK_OPEN + _MARK_MID + _MARK_CLOSE + _HOLE_OPEN + _HOLE_CLOSE
)
_SENTINEL = re.compile(f"{_SENT_OPEN}(\\d+){_SENT_CLOSE}")
_MARKER = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_MID}|{_MARK_CLOSE}")
# The render variable through which the marking ``tojson`` finds what to mark.
_MARKS_VAR = "__sgl_pic_marks"


class PieceSpan(NamedTuple):
    """Piece ``piece`` is ``text[start:end]`` of the rendering."""

    piece: int
    start: int
    end: int


class MarkError(ValueError):
    """A marked rendering whose markers do not pair up."""


class Marks(NamedTuple):
    """What one marked rendering marks. contents: piece id -> its real text (the content
    holds ``sentinel(piece)``); objects: id() of a tool object -> piece id."""

    contents: Mapping[int, str]
    objects: Mapping[int, int]


def sentinel(piece: int) -> str:
    """The string standing for piece ``piece``'s content in a marked rendering."""
    return f"{_SENT_OPEN}{piece}{_SENT_CLOSE}"


def holds_reserved(text: str) -> bool:
    """Whether ``text`` holds a code point the marked rendering reserves (such a piece
    stays fresh)."""
    return not RESERVED.isdisjoint(text)


def _open(piece: int) -> str:
    return f"{_MARK_OPEN}{piece}{_MARK_MID}"


@functools.lru_cache(maxsize=16)
def marking_template(source: str, compile_template: Callable[[str], Any]) -> Any:
    """``source`` compiled in an overlay of the environment ``compile_template`` compiles
    it in (transformers' chat-template environment, as SGLang's rendering uses), with a
    ``tojson`` that marks. Cached: templates are immutable text."""
    env = compile_template(source).environment
    overlay = env.overlay()
    filters = dict(env.filters)
    filters["tojson"] = _marking_tojson
    overlay.filters = filters
    return overlay.from_string(source)


@jinja2.pass_context
def _marking_tojson(
    context: Any,
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` (``json.dumps`` with these options), with each marked tool
    object and each content sentinel wrapped in markers."""
    marks: Marks | None = context.get(_MARKS_VAR)
    kw = {
        "ensure_ascii": ensure_ascii,
        "indent": indent,
        "separators": separators,
        "sort_keys": sort_keys,
    }
    if marks is None:
        return json.dumps(x, **kw)
    return _dump_marked(x, marks, kw)


def _dump_marked(x: Any, marks: Marks, kw: dict[str, Any]) -> str:
    holes: list[tuple[str, Any]] = []  # (placeholder, what it stands for)

    def swap(v: Any, top: bool) -> Any:
        if not top and isinstance(v, dict | list) and id(v) in marks.objects:
            holes.append((f"{_HOLE_OPEN}{len(holes)}{_HOLE_CLOSE}", v))
            return holes[-1][0]
        if isinstance(v, str) and _SENTINEL.fullmatch(v):
            holes.append((f"{_HOLE_OPEN}{len(holes)}{_HOLE_CLOSE}", v))
            return holes[-1][0]
        if isinstance(v, dict):
            return {k: swap(i, False) for k, i in v.items()}
        if isinstance(v, list | tuple):
            return [swap(i, False) for i in v]
        return v

    out = json.dumps(swap(x, True), **kw)
    for placeholder, value in holes:
        quoted = json.dumps(placeholder, ensure_ascii=kw["ensure_ascii"])
        at = out.find(quoted)
        if at < 0:
            continue
        if isinstance(value, str):
            piece = int(_SENTINEL.fullmatch(value).group(1))  # type: ignore[union-attr]
            text = json.dumps(marks.contents[piece], ensure_ascii=kw["ensure_ascii"])
            text = f'"{_open(piece)}{text[1:-1]}{_MARK_CLOSE}"'
        else:
            # Nested at the placeholder's line indentation, as json.dumps nests it (the
            # nested dump marks the object itself).
            head = out[out.rfind("\n", 0, at) + 1 : at]
            pad = head[: len(head) - len(head.lstrip())]
            text = _dump_marked(value, marks, kw).replace("\n", "\n" + pad)
        out = out[:at] + text + out[at + len(quoted) :]
    if id(x) in marks.objects:
        out = f"{_open(marks.objects[id(x)])}{out}{_MARK_CLOSE}"
    return out


def render_marked(template: Any, variables: dict[str, Any], marks: Marks) -> str:
    """The marked template's output (``marking_template``) for ``variables``, with each
    content sentinel put back as its text between markers."""
    return render_sentinels(template.render(**variables, **{_MARKS_VAR: marks}), marks.contents)


def render_sentinels(out: str, contents: Mapping[int, str]) -> str:
    """``out`` with each sentinel of ``contents`` put back as its text between markers."""
    return _SENTINEL.sub(
        lambda m: _open(int(m.group(1))) + contents[int(m.group(1))] + _MARK_CLOSE, out
    )


def resolve(marked: str) -> tuple[str, list[PieceSpan]]:
    """The text of a marked rendering without its markers, and the span of each piece that
    appears once (nested marks count for the outermost). Raises MarkError for unpaired
    markers."""
    text: list[str] = []
    pos = 0
    stack: list[tuple[int, int]] = []
    found: list[PieceSpan] = []
    seen: dict[int, int] = {}
    last = 0
    for m in _MARKER.finditer(marked):
        chunk = marked[last : m.start()]
        text.append(chunk)
        pos += len(chunk)
        last = m.end()
        if m.group(1) is not None:
            stack.append((int(m.group(1)), pos))
            continue
        if not stack:
            raise MarkError("a closing marker without an opening one")
        piece, start = stack.pop()
        if not stack:
            seen[piece] = seen.get(piece, 0) + 1
            found.append(PieceSpan(piece, start, pos))
    if stack:
        raise MarkError("an opening marker without a closing one")
    text.append(marked[last:])
    return "".join(text), [s for s in found if seen[s.piece] == 1 and s.end > s.start]


class Located(NamedTuple):
    """What ``locate`` found. spans: in text order; unsearched: pieces left fresh because
    the search ran out of renderings before reaching them."""

    spans: list[PieceSpan]
    unsearched: frozenset[int]


def locate(
    expected: str,
    attempt: Callable[[frozenset[int]], str],
    pieces: Iterable[int],
    search: Sequence[int] | None = None,
    max_renders: int | None = None,
) -> Located:
    """The spans in ``expected`` (the real rendering) of the pieces the template renders
    verbatim. ``attempt(subset)`` is the marked rendering with only ``subset`` marked.

    All ``pieces`` are tried at once (one rendering). When that does not give ``expected``
    back, only the pieces of ``search`` (default: all; in order of priority) are searched,
    by bisection: a group that keeps the rendering exact is kept whole, one that does not is
    split in two, a single piece that does not stays fresh. Each try renders the whole
    conversation, so the search makes at most ``max_renders`` renderings (None: no bound);
    the pieces it did not reach stay fresh and are reported as ``unsearched``."""
    wanted = frozenset(pieces)
    if not wanted:
        return Located([], frozenset())
    spans = _try(expected, attempt, wanted)
    if spans is not None and {s.piece for s in spans} == wanted:
        return Located(spans, frozenset())
    order = [p for p in dict.fromkeys(sorted(wanted) if search is None else search) if p in wanted]
    kept: frozenset[int] = frozenset()
    best: list[PieceSpan] = []
    renders = 0
    # Groups still to try, first in front (all of ``wanted`` was tried already).
    if set(order) != wanted:
        todo = [order] if order else []
    else:
        todo = _halves(order) if len(order) > 1 else []
    while todo:
        if max_renders is not None and renders >= max_renders:
            break
        group = todo.pop(0)
        renders += 1
        got = _try(expected, attempt, kept | frozenset(group))
        if got is not None and set(group) <= {s.piece for s in got}:
            kept = frozenset(s.piece for s in got)
            best = got
        elif len(group) > 1:
            todo[:0] = _halves(group)
    return Located(best, frozenset(p for g in todo for p in g))


def _halves(group: list[int]) -> list[list[int]]:
    mid = len(group) // 2
    return [group[:mid], group[mid:]]


def _try(
    expected: str, attempt: Callable[[frozenset[int]], str], subset: frozenset[int]
) -> list[PieceSpan] | None:
    try:
        text, spans = resolve(attempt(subset))
    except MarkError:
        return None
    except Exception:  # noqa: BLE001 - the template is the model's code; a failure keeps pieces fresh
        return None
    if text != expected:
        return None
    return sorted(spans, key=lambda s: s.start)


def tokenize_spans(
    text: str, spans: Sequence[PieceSpan], tokenize: Callable[[str], list[int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` with each span tokenized on its own and the text between spans
    tokenized as it stands, and each span's token range (same order as ``spans``, which
    must be sorted and disjoint)."""
    ids: list[int] = []
    ranges: list[tuple[int, int]] = []
    pos = 0
    for s in spans:
        if s.start > pos:
            ids += tokenize(text[pos : s.start])
        start = len(ids)
        ids += tokenize(text[s.start : s.end])
        ranges.append((start, len(ids)))
        pos = s.end
    if pos < len(text):
        ids += tokenize(text[pos:])
    return ids, ranges


def unmark(value: Any, contents: Mapping[int, str]) -> Any:
    """``value`` (plain data: dicts, lists, strings) with the sentinels of ``contents`` put
    back as their real text (other sentinels kept); what is unchanged is shared."""
    if isinstance(value, str):
        if _SENT_OPEN not in value:
            return value
        return _SENTINEL.sub(
            lambda m: contents.get(int(m.group(1)), m.group(0)),  # type: ignore[arg-type]
            value,
        )
    if isinstance(value, dict):
        return {k: unmark(v, contents) for k, v in value.items()}
    if isinstance(value, list):
        return [unmark(v, contents) for v in value]
    return value


def sentinel_piece(text: Any) -> int | None:
    """The piece whose sentinel ``text`` is, else None."""
    m = _SENTINEL.fullmatch(text) if isinstance(text, str) else None
    return int(m.group(1)) if m else None
