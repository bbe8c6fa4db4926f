"""Content-defined cut points for long auto-chunked messages.

A message longer than ``segment_tokens`` is split into several chunks. Fixed windows from
its start would make every window after an edit differ (an inserted word shifts them all),
so a document that grows by a paragraph, or a tool result that changes one field, would
miss the cache from the edit to its end. Cuts are instead placed where the tokens
themselves say (content-defined chunking, as in LBFS and FastCDC, over token ids rather
than bytes): after token i when a hash of the ``WINDOW`` tokens ending at i is 0 modulo a
divisor. The decision reads only those tokens and the length since the last cut, so once
the edited and the old text share a cut (usually the first or second hash cut past the
edit), every window after it, and its cache key, is the same in both.

Window lengths are bounded: at least ``size // 4`` tokens (and ``min_tokens``), at most
``size`` (a cut is forced there), about ``size / 2`` on average. A tail shorter than
``min_tokens`` joins the window before it (which may then pass ``size`` by less than
``min_tokens``: the store cuts it into segments of ``size`` anyway, ``keys.segment_keys``).

The hash is our own arithmetic on token ids (splitmix64 per token, a polynomial over the
window mod 2**61 - 1), never Python's ``hash``: cuts must agree across processes, servers
and versions, or two servers sharing a store would key the same message differently.
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 16  # tokens the cut decision hashes
_PRIME = (1 << 61) - 1
_BASE = 1_000_003
_MASK64 = (1 << 64) - 1


def _mix(token: int) -> int:
    """splitmix64 of a token id: neighbouring ids hash far apart."""
    z = (token + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def cut_points(token_ids: Sequence[int], size: int, min_tokens: int) -> list[int]:
    """Offsets (within ``token_ids``) where its windows end, ascending, the last one
    ``len(token_ids)``; one window when it is at most ``size`` tokens long."""
    n = len(token_ids)
    if size < 1 or min_tokens < 1:
        raise ValueError(f"size and min_tokens must be >= 1, got {size} and {min_tokens}")
    if n <= size:
        return [n]
    low = min(max(size // 4, min_tokens), size)
    divisor = max((size - low) // 2, 1)  # expected window: low + divisor, about size / 2
    drop = pow(_BASE, WINDOW - 1, _PRIME)  # weight of the token leaving the window
    mixed = [_mix(int(t)) % _PRIME for t in token_ids]
    cuts: list[int] = []
    start = 0
    h = 0
    for i, m in enumerate(mixed):
        if i >= WINDOW:
            h = (h - mixed[i - WINDOW] * drop) % _PRIME
        h = (h * _BASE + m) % _PRIME
        length = i + 1 - start
        if length >= size or (length >= low and i + 1 >= WINDOW and h % divisor == 0):
            cuts.append(i + 1)
            start = i + 1
    if not cuts or cuts[-1] != n:
        if cuts and n - cuts[-1] < min_tokens:
            cuts[-1] = n  # a tail too short to be a chunk joins the window before it
        else:
            cuts.append(n)
    return cuts
