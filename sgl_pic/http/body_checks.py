"""Checks of a parsed request body that answer a client's mistake with a 400 before
SGLang sees it (``LayoutError``; ``PicHTTPMiddleware`` turns it into the response):

- any body: JSON nested deeper than ``max_json_depth``, internal keys a client may not
  send (``sgl_pic_*`` custom params, an ``sgl_pic`` extra key), a ``pic_chunk`` mark that
  is not a boolean (``check_client_body``);
- on /generate, /v1/completions and chat: text that is not valid Unicode (a lone UTF-16
  surrogate such as JSON's ``"\\ud800"``, which the tokenizer cannot take:
  ``check_body_text``), a ``stop_regex`` that does not compile, a ``rid`` that does not
  fit the request (a list for a single request, a batch's of another length:
  ``check_generation_options``); SGLang alone answers these with a 500.

Pure functions of the body, run in the server's HTTP process; they change nothing.
"""

from __future__ import annotations

import re
from typing import Any

from sgl_pic.core.spans import INTERNAL_PREFIX
from sgl_pic.http.routes import COMPLETIONS_PATH, GENERATE_PATH
from sgl_pic.layout import LayoutError, check_unicode

# Where one can stand in a body: an escape "\uD8xx".."\uDFxx", or the bytes of an encoded
# surrogate (json.loads decodes with surrogatepass). Bodies without either skip the walk.
_RAW_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# SGLang's own bounds on stop_regex (sampling_params.py, refused there with a 400); here they
# only bound the patterns compiled in the event loop.
_STOP_REGEX_MAX_CHARS = 256
_STOP_REGEX_MAX_COUNT = 32


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


def has_raw_surrogate(body: bytes) -> bool:
    """Whether a plain UTF-8 body may hold a lone surrogate (an escape or its encoded
    bytes); bodies without either need no ``check_body_text`` walk."""
    return _RAW_SURROGATE.search(body) is not None
