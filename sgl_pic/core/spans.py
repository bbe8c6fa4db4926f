"""Chunk marks of one request: parsed from the API, validated, carried to the scheduler.

They ride in ``sampling_params.custom_params`` (keys below) because SGLang
already carries that JSON dict unchanged from the HTTP server to the scheduler's ``Req``.
Anyone can put keys there, so the marks carry an HMAC (``MAC_KEY``) over themselves and the
request's token ids, made with a per-launch secret by our HTTP translation; the scheduler
honours only marks whose MAC checks out against the tokens it actually received.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sgl_pic.config import REQUEST_OVERRIDES, PicConfig
from sgl_pic.core.tenants import PUBLIC_SCOPE_OPTION
from sgl_pic.layout import LayoutError, PromptLayout

# custom_params values must be JSON scalars, flat lists or flat dicts (msgpack IPC), so the
# marks travel as flat keys: [s0, e0, s1, e1, ...], the prompt length, overrides, the MAC.
CHUNKS_KEY = "sgl_pic_chunks"
NUM_TOKENS_KEY = "sgl_pic_num_tokens"
CONFIG_KEY = "sgl_pic_config"
MAC_KEY = "sgl_pic_mac"
# The only keys of ours marks may carry; any other is forged (the gate ignores the marks).
MARK_KEYS = frozenset({CHUNKS_KEY, NUM_TOKENS_KEY, CONFIG_KEY, MAC_KEY})
# Every key or prefix-tree namespace of ours starts with this; a client may send none.
INTERNAL_PREFIX = "sgl_pic"
# Domain tag of internal commands' MACs (``MarkSigner.sign_command``).
_COMMAND_TAG = b"sgl_pic.command-v1\x00"
# Per-request overrides a client may send; server-only settings (page size, segment length,
# delimiter, limits, CacheTune's alpha) are excluded because they change how chunks are
# keyed, bounded or ranked when stored. Declared on PicConfig's fields.
OVERRIDABLE = REQUEST_OVERRIDES


@dataclass(frozen=True)
class PicRequest:
    """layout: validated chunk spans; overrides: per-request PicConfig fields;
    public_scope: whether the request asked to read the server's public chunk namespaces
    (``sgl_pic.core.tenants``) besides its own."""

    layout: PromptLayout
    overrides: Mapping[str, Any]
    public_scope: bool = False

    def config(self, base: PicConfig) -> PicConfig:
        return base.with_overrides(**dict(self.overrides)) if self.overrides else base


class MarkSigner:
    """HMAC-SHA256 of a request's marks and token ids under a per-launch secret.

    Stateless after construction; safe to share between threads."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a mark signer needs a non-empty secret")
        self._key = secret.encode()

    def sign(self, token_ids: Sequence[int], marks: Mapping[str, Any]) -> str:
        """The MAC of ``marks`` (the three entries ``encode`` makes) over ``token_ids``."""
        payload = json.dumps(
            [marks[CHUNKS_KEY], marks[NUM_TOKENS_KEY], marks[CONFIG_KEY]],
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        h = hmac.new(self._key, payload, hashlib.sha256)
        # Fixed-width ids: no two token lists share bytes (ids were range-checked before).
        h.update(array("q", token_ids).tobytes())
        return h.hexdigest()

    def verify(self, token_ids: Sequence[int], custom_params: Mapping[str, Any]) -> bool:
        """Whether ``custom_params`` carries marks this signer made for exactly these tokens."""
        mac = custom_params.get(MAC_KEY)
        if not isinstance(mac, str):
            return False
        return hmac.compare_digest(mac, self.sign(token_ids, custom_params))

    def sign_command(self, payload: str) -> str:
        """The MAC of an internal command (``delete_command``): the same secret as the
        marks, under a tag of its own, so no mark's MAC is a command's and none the
        reverse (a marks payload starts with "[", a command's with the tag)."""
        h = hmac.new(self._key, _COMMAND_TAG, hashlib.sha256)
        h.update(payload.encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def verify_command(self, payload: Any, mac: Any) -> bool:
        """Whether ``mac`` is this signer's MAC of the command ``payload``."""
        if not (isinstance(payload, str) and isinstance(mac, str)):
            return False
        return hmac.compare_digest(mac, self.sign_command(payload))


class LimitError(LayoutError):
    """Marks that are well formed but over a server limit (too many or too short chunks)."""


def check_limits(layout: PromptLayout, config: PicConfig) -> None:
    """Raises LimitError when ``layout`` exceeds the server's chunk-count or chunk-length
    limits; both the HTTP edge and the scheduler apply it."""
    if len(layout.chunks) > config.max_chunks:
        raise LimitError(
            f"{len(layout.chunks)} chunks marked; this server takes at most {config.max_chunks} "
            "per request (--pic-max-chunks)"
        )
    for i, span in enumerate(layout.chunks):
        if span.length < config.min_chunk_tokens:
            raise LimitError(
                f"chunk {i} has {span.length} token(s); this server needs at least "
                f"{config.min_chunk_tokens} per chunk (--pic-min-chunk-tokens)"
            )


def check_overrides(overrides: Any, base: PicConfig) -> dict[str, Any]:
    """Validated per-request overrides (raises LayoutError with a client-facing message)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise LayoutError(f"'config' must be an object, got {type(overrides).__name__}")
    bad = sorted(set(overrides) - OVERRIDABLE - {PUBLIC_SCOPE_OPTION})
    if bad:
        raise LayoutError(
            f"settings {bad} cannot be overridden per request; allowed: "
            f"{sorted(OVERRIDABLE | {PUBLIC_SCOPE_OPTION})}"
        )
    if PUBLIC_SCOPE_OPTION in overrides and not isinstance(overrides[PUBLIC_SCOPE_OPTION], bool):
        raise LayoutError(
            f"'{PUBLIC_SCOPE_OPTION}' must be true or false, got {overrides[PUBLIC_SCOPE_OPTION]!r}"
        )
    fields = {k: v for k, v in overrides.items() if k != PUBLIC_SCOPE_OPTION}
    try:
        base.with_overrides(**fields)
    except (TypeError, ValueError) as e:
        raise LayoutError(str(e)) from e
    return dict(overrides)


def encode(layout: PromptLayout, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The custom_params entries for one request (unsigned)."""
    return {
        CHUNKS_KEY: [v for s in layout.chunks for v in (s.start, s.end)],
        NUM_TOKENS_KEY: layout.num_tokens,
        CONFIG_KEY: dict(overrides),
    }


def has_marks(custom_params: Any) -> bool:
    """Whether ``custom_params`` holds any key of ours (signed or not)."""
    return isinstance(custom_params, Mapping) and any(
        isinstance(k, str) and k.startswith(INTERNAL_PREFIX) for k in custom_params
    )


def decode(custom_params: Mapping[str, Any], base: PicConfig) -> PicRequest:
    """The request's chunk marks, validated against ``base`` (overrides and limits).
    Raises LayoutError (LimitError for limits) on anything malformed; the caller decides
    what that means (the scheduler: exact prefill)."""
    flat = custom_params.get(CHUNKS_KEY)
    n = custom_params.get(NUM_TOKENS_KEY)
    if not isinstance(flat, list | tuple) or len(flat) % 2 or type(n) is not int:
        raise LayoutError("chunk marks need a flat list of span bounds and a token count")
    pairs = [list(flat[i : i + 2]) for i in range(0, len(flat), 2)]
    layout = PromptLayout.from_spans(n, pairs)
    overrides = check_overrides(custom_params.get(CONFIG_KEY) or {}, base)
    check_limits(layout, base)
    public = bool(overrides.pop(PUBLIC_SCOPE_OPTION, False))
    return PicRequest(layout, overrides, public)


class SpecialTokens(NamedTuple):
    """Ids the tokenizer adds around a whole prompt (e.g. BOS in front)."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


NO_SPECIAL_TOKENS = SpecialTokens()


def special_tokens(tokenize: Callable[[str, bool], list[int]]) -> SpecialTokens:
    """What ``tokenize(text, add_special_tokens=True)`` adds around the plain ids of a probe
    text. A delimited prompt is tokenized piecewise without special tokens and wrapped in
    these, so a prompt that starts with a chunk still gets its BOS."""
    probe = "Hello"
    plain = tokenize(probe, False)
    full = tokenize(probe, True)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return SpecialTokens(tuple(full[:i]), tuple(full[i + len(plain) :]))
    raise LayoutError("the tokenizer's special tokens do not wrap its plain ids")


def split_on_delimiter(
    text: str,
    delimiter: str,
    tokenize: Callable[[str], list[int]],
    specials: SpecialTokens = NO_SPECIAL_TOKENS,
) -> tuple[list[int], PromptLayout]:
    """Token ids and chunk spans of ``text`` whose chunks are enclosed in delimiter pairs.

    ``before <d>chunk A<d> between <d>chunk B<d> after``: the delimiters alternate open and
    close. Each piece is tokenized on its own without special tokens (``tokenize(piece)``),
    so a chunk's tokens, and hence its cache key, never depend on the text around it; the
    prompt is then wrapped in ``specials`` (fresh tokens, e.g. BOS).
    """
    pieces = text.split(delimiter)
    if len(pieces) % 2 == 0:
        raise LayoutError(
            f"unbalanced chunk delimiters: {len(pieces) - 1} occurrence(s) of {delimiter!r}; "
            "each chunk needs an opening and a closing delimiter"
        )
    ids: list[int] = list(specials.prefix)
    spans: list[list[int]] = []
    for i, piece in enumerate(pieces):
        toks = tokenize(piece) if piece else []
        if i % 2 == 1:
            if not toks:
                raise LayoutError(f"chunk {len(spans)} is empty (nothing between delimiters)")
            spans.append([len(ids), len(ids) + len(toks)])
        ids.extend(toks)
    if len(ids) == len(specials.prefix):
        raise LayoutError("the prompt is empty")
    ids.extend(specials.suffix)
    return ids, PromptLayout.from_spans(len(ids), spans)


def layout_from_spans(input_ids: Sequence[int], chunks: Any) -> PromptLayout:
    """Validated layout of explicit ``[[start, end], ...]`` spans over ``input_ids``."""
    if not isinstance(chunks, list):
        raise LayoutError(f"'chunks' must be a list of [start, end] pairs, got {chunks!r}")
    for i, pair in enumerate(chunks):
        if not isinstance(pair, list | tuple):
            raise LayoutError(f"chunk {i} must be a pair of integers [start, end], got {pair!r}")
    return PromptLayout.from_spans(len(input_ids), chunks)
