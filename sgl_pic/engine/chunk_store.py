"""Phase 1's store step, bounded: one encoded miss's CacheTune ranking, and its KV copied
from where phase 1 encoded it into its chunk nodes, its lower-tier records and the
request's slots, a bounded piece at a time.

The miss's n tokens sit in the pool with keys at positions at..at+n-1 (``at``: its
encoding context's length). They leave as chunk nodes (keys at 0..n-1), host-tier records
(keys before RoPE, one per segment) and the request's rows (keys at start..start+n-1).
Nothing holds a whole long miss at once, in every layer, on the device:

* the ranking (``rank_miss``) reads the pool in slabs of columns, every token of a few
  channels (rotary pairs of K, channels of V) of one layer, or of whole layers when
  they fit, and sums their low-passed energy per token (``LowPassEnergy``);
* the copies (``store_miss``) go window by window, a window being one or more whole
  lower-tier segments, whose records are assembled whole and handed over when it ends;
  within a window, pieces of a few layers, or of some rows of one layer, are gathered,
  rotated and written out.

Slabs and pieces stay within ``KVAccess.staging_bytes`` (a slab: one column at least; a
piece: one row of one layer at least). Each piece takes the rotations a read of the whole
miss took, in the same order (-at; then -t for the records; then +start for the request),
through the same ops, so what is written is what that read wrote, bit for bit; the
ranking may differ from ``cachetune_ranking`` of the whole miss in float rounding only.
Slots are checked against the pool once per destination (one host read each); pieces
then use torch's own index ops. A rotary table without plain frequencies rotates whole
heads and reads its largest shift on the host per call (``ModelRope.rotate``): there,
one host read per rotated slab or piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.keys import SegmentKey
from sgl_pic.rope import rope_cos_sin, rotate_with
from sgl_pic.selection.cachetune import LowPassEnergy, Slab, slabs

# Float32 rows of K one stored piece holds per row it moves: the staged K and V, the
# rotation's float32 input, result and cast back, and the records' pre-RoPE copy with
# its own rotation's float32 rows.
PIECE_ROWS_PER_ROW = 8
# Float32 copies of a ranking slab held at once: the gathered columns with their float32
# rotation, the spectrum (complex, half the bins), the filtered columns and their squares.
SLAB_COPIES = 6


class Destination(NamedTuple):
    """Rows [start, start + m) of the miss go to ``slots`` (# [m] from
    ``KVAccess.checked``)."""

    slots: torch.Tensor
    start: int


class RecordSink(NamedTuple):
    """The miss's lower-tier segments (``keys``, in order; those in ``new`` are not held
    yet) and ``put(key, k_pre, v)``, which hands one assembled segment over, each
    # [num_layers, key.end - key.start, num_kv_heads, head_dim]."""

    keys: tuple[SegmentKey, ...]
    new: frozenset[str]
    put: Callable[[SegmentKey, torch.Tensor, torch.Tensor], object]


def rank_miss(
    kv: KVAccess,
    rows: torch.Tensor,  # [n] from ``KVAccess.checked``: the miss, keys at at..at+n-1
    at: int,
    alpha: float,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """# [n] float32: ``cachetune_ranking`` of the miss's pre-RoPE keys and its values,
    read from the pool slab by slab (module doc); ``reduce`` as there."""
    first = kv.pool.get_key_buffer(0)
    heads, dim = first.shape[1], first.shape[2]
    n = rows.numel()
    energy = LowPassEnergy(kv.num_layers, n, alpha, kv.device, first.dtype)
    budget = max(1, kv.staging_bytes // (4 * SLAB_COPIES))
    for s in slabs(kv.num_layers, heads * dim, n, budget):
        energy.add(1, s.layer, _value_columns(kv, rows, s, heads * dim))
    # K's columns come in rotary pairs (plain RoPE) or whole heads (a rotary table, whose
    # rotation takes whole heads): a slab never splits one.
    width = dim // 2 if kv.rope.spec.inv_freq is not None else 1
    for s in slabs(kv.num_layers, heads * width, n * dim // width, budget):
        energy.add(0, s.layer, _key_columns(kv, rows, at, s, heads * width))
    return energy.ranking(reduce)


def store_miss(
    kv: KVAccess,
    rows: torch.Tensor,  # [n] from ``KVAccess.checked``: the miss, keys at at..at+n-1
    at: int,
    nodes: Sequence[Destination],
    request: Destination | None,
    start: int,
    records: RecordSink | None,
) -> None:
    """Writes the miss to ``nodes`` (keys at 0..n-1) and to ``request`` (keys at
    start..start+n-1; its slots may be ``rows`` themselves: each piece is read before it
    is written), and hands ``records`` its new segments (keys before RoPE). Rank first:
    the request's rows may be the miss's own."""
    n = rows.numel()
    first = kv.pool.get_key_buffer(0)
    row_bytes = PIECE_ROWS_PER_ROW * first[0].numel() * 4
    keys = records.keys if records is not None else ()
    new = records.new if records is not None else frozenset()
    for w0, w1 in _windows(n, keys, kv.num_layers * row_bytes, kv.staging_bytes):
        window = [k for k in keys if w0 <= k.start and k.end <= w1]
        # The window's new records, filled piece by piece: storage once handed over.
        made = {
            k.digest: (
                first.new_empty((kv.num_layers, k.end - k.start, *first.shape[1:])),
                first.new_empty((kv.num_layers, k.end - k.start, *first.shape[1:])),
            )
            for k in window
            if k.digest in new
        }
        for p in slabs(kv.num_layers, w1 - w0, row_bytes, kv.staging_bytes):
            r0, r1 = w0 + p.start, w0 + p.end
            piece = kv.gather(rows[r0:r1], p.layer, p.layer_end)  # [layers, 2, t, H, D]
            if at:
                kv.rotate_in_place(piece[:, 0], -at)
            for node in nodes:
                _write_rows(kv, node, piece, r0, p.layer)
            if any(k.digest in made and k.start < r1 and r0 < k.end for k in window):
                pre = kv.rotated(piece[:, 0], -torch.arange(r0, r1, device=kv.device))
                for k in window:
                    if k.digest in made and k.start < r1 and r0 < k.end:
                        a, b = max(r0, k.start), min(r1, k.end)
                        k_rec, v_rec = made[k.digest]
                        layers = slice(p.layer, p.layer_end)
                        k_rec[layers, a - k.start : b - k.start] = pre[:, a - r0 : b - r0]
                        v_rec[layers, a - k.start : b - k.start] = piece[:, 1, a - r0 : b - r0]
                del pre
            if request is not None:
                if start:
                    kv.rotate_in_place(piece[:, 0], start)
                _write_rows(kv, request, piece, r0, p.layer)
            del piece
        for k in window:
            if records is not None and k.digest in made:
                records.put(k, *made.pop(k.digest))  # handed over whole, never written again


def _windows(
    n: int, keys: Sequence[SegmentKey], all_layers_row_bytes: int, budget: int
) -> list[tuple[int, int]]:
    """Token ranges stored one after the other: whole segments of ``keys`` (all of [0, n)
    without them), consecutive ones joined while every layer of them fits ``budget``."""
    out: list[tuple[int, int]] = []
    for s, e in [(k.start, k.end) for k in keys] or [(0, n)]:
        if out and (e - out[-1][0]) * all_layers_row_bytes <= budget:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _write_rows(
    kv: KVAccess,
    dest: Destination,
    piece: torch.Tensor,  # [layers, 2, t, num_kv_heads, head_dim], rows r0..r0+t-1
    r0: int,
    layer: int,
) -> None:
    """The rows of ``piece`` that ``dest`` takes, written to its slots."""
    a = max(r0, dest.start)
    b = min(r0 + piece.shape[2], dest.start + dest.slots.numel())
    if a < b:
        kv.scatter(dest.slots[a - dest.start : b - dest.start], piece[:, :, a - r0 : b - r0], layer)


def _whole_layers(kv: KVAccess, rows: torch.Tensor, s: Slab, values: bool) -> torch.Tensor:
    """# [layers, n, num_kv_heads, head_dim] K (or V) of slab ``s``'s layers at ``rows``,
    gathered straight into one tensor."""
    buffer = kv.pool.get_value_buffer if values else kv.pool.get_key_buffer
    first = buffer(s.layer)
    out = first.new_empty((s.layer_end - s.layer, rows.numel(), *first.shape[1:]))
    for i, layer in enumerate(range(s.layer, s.layer_end)):
        torch.index_select(buffer(layer), 0, rows, out=out[i])
    return out


def _value_columns(kv: KVAccess, rows: torch.Tensor, s: Slab, columns: int) -> torch.Tensor:
    """# [layers, n, c] V's columns of slab ``s`` (whole layers, or columns of one)."""
    if s.start == 0 and s.end == columns:
        return _whole_layers(kv, rows, s, values=True).flatten(2)
    buf = kv.pool.get_value_buffer(s.layer)
    column = torch.arange(s.start, s.end, device=kv.device)
    dim = buf.shape[2]
    # Indexed by (slot, head, channel), whatever the buffer's strides: only the slab's
    # elements are copied out.
    return buf[rows[:, None], column // dim, column % dim][None]


def _key_columns(kv: KVAccess, rows: torch.Tensor, at: int, s: Slab, units: int) -> torch.Tensor:
    """# [layers, n, c] pre-RoPE K's columns of slab ``s``: whole layers, rotated as
    ``store_miss`` rotates the records' keys (-at, then -t); or units of one layer,
    rotary pairs (plain RoPE) or heads (a rotary table), rotated the same way."""
    n = rows.numel()
    back = -torch.arange(n, device=kv.device)
    if s.start == 0 and s.end == units:
        keys = _whole_layers(kv, rows, s, values=False)
        if at:
            kv.rotate_in_place(keys, -at)
        return kv.rotated(keys, back).flatten(2)
    buf = kv.pool.get_key_buffer(s.layer)
    spec = kv.rope.spec
    if spec.inv_freq is None:
        heads = buf[:, s.start : s.end].index_select(0, rows)[None]  # [1, n, h, D]
        if at:
            heads = kv.rotated(heads, -at)
        return kv.rotated(heads, back).flatten(2)
    # Each pair as a neox half and its partner (either layout's pairing), so that
    # ``rotate_with`` rotates it as the ops rotate it in a head.
    dim = buf.shape[2]
    half = dim // 2
    unit = torch.arange(s.start, s.end, device=kv.device)
    head, pair = unit // half, unit % half
    one = pair if spec.layout == "neox" else 2 * pair
    other = one + (half if spec.layout == "neox" else 1)
    slot = rows[:, None]
    x = torch.cat([buf[slot, head, one], buf[slot, head, other]], dim=1)[:, None]
    inv_freq = spec.inv_freq.to(kv.device)[pair]
    if at:
        x = rotate_with(x, *rope_cos_sin(torch.full_like(back, -at), inv_freq), "neox")
    return rotate_with(x, *rope_cos_sin(back, inv_freq), "neox").flatten(1)[None]
