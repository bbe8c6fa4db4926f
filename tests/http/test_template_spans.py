"""template_spans: the marking ``tojson`` serialises exactly as ``json.dumps`` once its
markers are removed; markers pair up or are refused; ``locate`` keeps the pieces a
template renders verbatim and drops the others."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sgl_pic.http.template_spans import (
    Located,
    MarkError,
    Marks,
    PieceSpan,
    _dump_marked,
    locate,
    render_sentinels,
    resolve,
    sentinel,
    tokenize_spans,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"a": [1, 2], "b": "é"}}}
OPTIONS = [
    {},
    {"indent": 2},
    {"indent": 4, "sort_keys": True},
    {"separators": (",", ":")},
    {"ensure_ascii": True},
    {"indent": "\t"},
]


def kw(**o: Any) -> dict[str, Any]:
    return {"ensure_ascii": False, "indent": None, "separators": None, "sort_keys": False, **o}


@pytest.mark.parametrize("options", OPTIONS)
def test_marked_json_is_json_dumps_once_unmarked(options: dict[str, Any]) -> None:
    other = {"type": "function", "function": {"name": "g"}}
    data = {"tools": [TOOL, other], "note": sentinel(0)}
    marks = Marks({0: 'say "hi"\n'}, {id(TOOL): 5, id(TOOL["function"]): 5})
    text, spans = resolve(_dump_marked(data, marks, kw(**options)))
    real = {"tools": [TOOL, other], "note": 'say "hi"\n'}
    assert text == json.dumps(real, **kw(**options))
    by_piece = {s.piece: text[s.start : s.end] for s in spans}
    # The tool's span is its serialisation at its place (the nested indentation included).
    assert json.loads(by_piece[5]) == TOOL
    assert by_piece[0] == json.dumps('say "hi"\n', **kw(**options))[1:-1]


def test_markers_must_pair() -> None:
    marks = Marks({1: "a"}, {})
    assert resolve(render_sentinels(f"x{sentinel(1)}y", marks.contents)) == (
        "xay",
        [PieceSpan(1, 1, 2)],
    )
    for bad in ("a\ue004", "\ue0021\ue003a"):
        with pytest.raises(MarkError):
            resolve(bad)
    # A piece rendered twice is no span.
    assert resolve(render_sentinels(f"{sentinel(1)}-{sentinel(1)}", marks.contents))[1] == []


def test_locate_keeps_the_pieces_rendered_verbatim() -> None:
    texts = {0: "alpha ", 1: "beta", 2: "gamma"}

    def render(contents: dict[int, str]) -> str:
        # Piece 0 is trimmed by the template: not verbatim.
        return f"<{contents[0].strip()}><{contents[1]}><{contents[2]}>"

    expected = render(texts)

    def attempt(subset: frozenset[int]) -> str:
        shown = {k: sentinel(k) if k in subset else t for k, t in texts.items()}
        return render_sentinels(render(shown), {k: texts[k] for k in subset})

    spans, unsearched = locate(expected, attempt, [0, 1, 2])
    assert not unsearched
    assert [(s.piece, expected[s.start : s.end]) for s in spans] == [(1, "beta"), (2, "gamma")]
    ids, ranges = tokenize_spans(expected, spans, lambda t: [ord(c) for c in t])
    assert "".join(map(chr, ids)) == expected
    assert ["".join(map(chr, ids[a:b])) for a, b in ranges] == ["beta", "gamma"]


def trimming(texts: dict[int, str]) -> tuple[str, Any]:
    """A template rendering each text between brackets, stripped (so a text with outer
    whitespace is not rendered verbatim); its real rendering and a counted ``attempt``."""

    def render(contents: dict[int, str]) -> str:
        return "".join(f"<{contents[k].strip()}>" for k in sorted(contents))

    def attempt(subset: frozenset[int]) -> str:
        attempt.calls += 1  # type: ignore[attr-defined]
        shown = {k: sentinel(k) if k in subset else t for k, t in texts.items()}
        return render_sentinels(render(shown), {k: texts[k] for k in subset})

    attempt.calls = 0  # type: ignore[attr-defined]
    return render(texts), attempt


def test_locate_searches_by_bisection_within_a_bound() -> None:
    """One trimmed piece among many costs a few renderings (not one per piece); only the
    pieces of ``search`` are searched; past ``max_renders`` the rest stay fresh."""
    n = 512
    texts = {k: f"text {k}" for k in range(n)}
    texts[77] += "\n"
    expected, attempt = trimming(texts)
    spans, unsearched = locate(expected, attempt, range(n))
    assert {s.piece for s in spans} == set(range(n)) - {77} and not unsearched
    assert attempt.calls <= 2 + 2 * 10  # all at once, then two tries per level
    # Only the pieces searched for.
    expected, attempt = trimming(texts)
    spans, _ = locate(expected, attempt, range(n), search=[3, 77, 400])
    assert {s.piece for s in spans} == {3, 400} and attempt.calls <= 6
    # Every piece trimmed: the bound holds, the rest is reported unsearched.
    texts = {k: f" text {k}" for k in range(n)}
    expected, attempt = trimming(texts)
    got = locate(expected, attempt, range(n), max_renders=20)
    assert isinstance(got, Located) and got.spans == [] and attempt.calls == 21
    assert got.unsearched and got.unsearched <= set(range(n))
