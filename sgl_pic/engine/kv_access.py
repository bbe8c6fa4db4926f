"""Reading and writing one request's KV across all layers of SGLang's token pool."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from sgl_pic.engine.rotation import ModelRope
from sgl_pic.ops import (
    apply_rope_kv,
    apply_rope_kv_layer,
    read_pool_kv,
    rotated_keys,
    write_pool_kv,
)
from sgl_pic.ops.pool import check_slots
from sgl_pic.ops.validate import checked_rows
from sgl_pic.rope import rope_cos_sin, rotate_with


@contextmanager
def single_thread() -> Iterator[None]:
    """Runs row copies on one intra-op thread: they are memory-bound, and on a loaded CPU
    OpenMP's barriers made them up to 200x slower with 2 threads than with 1 (measured:
    30 index-puts of 500x3x64 floats, 0.45 s vs 0.0024 s)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


SLICE_ROWS = 16
# Most ``copy_rotated`` stages at once (rows of one layer and their rotation's working
# copies), whatever a batch reuses: memory outside SGLang's budget for the pool.
STAGING_BYTES = 64 << 20
# Bytes ``copy_rotated`` stages per row of one layer, in units of a float32 row of K:
# the gathered K (at most float32), the rotation's float32 result, its cast back, the
# gathered V, and a row of angles (cos and sin, head_dim floats in all).
STAGED_ROWS_PER_ROW = 5


class SliceRun(NamedTuple):
    """Rows src..src+rows-1 copied to dst..dst+rows-1, keys moved by ``delta``."""

    src: int
    dst: int
    rows: int
    delta: int


class SliceRuns(NamedTuple):
    """``copy_rotated``'s split of its rows: runs copied slice to slice, and the indices
    (# [m] int64, into the rows) of the rest, gathered and scattered."""

    runs: list[SliceRun]
    rest: torch.Tensor


def slice_runs(
    src: torch.Tensor,  # [n] int64
    dst: torch.Tensor,  # [n] int64
    delta: torch.Tensor,  # [n] int64
    min_rows: int,
    max_rows: int | None = None,
) -> SliceRuns:
    """Maximal runs of rows whose source and destination slots both go up by one with one
    ``delta``; those of at least ``min_rows`` rows become ``SliceRun``s, cut into runs of
    at most ``max_rows`` rows (None: uncut). Reads the indices on the host."""
    n = src.numel()
    if n == 0:
        return SliceRuns([], src.new_empty(0))
    breaks = (src[1:] != src[:-1] + 1) | (dst[1:] != dst[:-1] + 1) | (delta[1:] != delta[:-1])
    starts = [0] + (torch.nonzero(breaks).flatten() + 1).tolist()
    ends = starts[1:] + [n]
    runs: list[SliceRun] = []
    rest: list[torch.Tensor] = []
    src_l, dst_l, delta_l = src[starts].tolist(), dst[starts].tolist(), delta[starts].tolist()
    for i, (a, z) in enumerate(zip(starts, ends, strict=True)):
        if z - a >= min_rows:
            step = z - a if max_rows is None else max_rows
            for o in range(0, z - a, step):
                rows = min(step, z - a - o)
                runs.append(SliceRun(src_l[i] + o, dst_l[i] + o, rows, delta_l[i]))
        else:
            rest.append(torch.arange(a, z, device=src.device))
    return SliceRuns(runs, torch.cat(rest) if rest else src.new_empty(0))


class KVAccess:
    """pool: SGLang's MHATokenToKVPool (get_key_buffer / get_value_buffer per layer).
    rope: the model's own rotation (``model_rope``). Every tensor made here lives on the
    pool's device. Writes and rotations go through ``sgl_pic.ops`` (the CUDA kernels when
    the pool is on a GPU, the torch reference otherwise), except ``copy_rotated``'s pool to
    pool copies (torch's index ops, one layer and piece at a time, slots checked once); a
    rotary table that is not plain whole-head RoPE (partial rotary, attention scaling)
    rotates through the table."""

    def __init__(
        self, pool: Any, num_layers: int, rope: ModelRope, staging_bytes: int = STAGING_BYTES
    ) -> None:
        self.pool = pool
        self.num_layers = num_layers
        self.rope = rope
        first = pool.get_key_buffer(0)
        self.device = first.device
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {staging_bytes}")
        self.staging_bytes = staging_bytes
        # Rows ``copy_rotated`` moves at once, so that what it stages stays within
        # ``staging_bytes`` (at least one row).
        per_row = STAGED_ROWS_PER_ROW * first[0].numel() * 4
        self.piece_rows = max(1, staging_bytes // per_row)
        # How ``copy_rotated`` runs: layer by layer on the CPU (see there), through the
        # ops' all-layer kernels elsewhere.
        self.per_layer_copies = self.device.type == "cpu"
        # Shortest run of rows copied slice to slice there: a slice costs a few ops per
        # layer whatever its length, a gathered row a fixed share of one.
        self.slice_rows = SLICE_ROWS

    def read(self, slots: torch.Tensor, at: int = 0) -> torch.Tensor:
        """# [num_layers, 2, n, num_kv_heads, head_dim] copy of the KV at ``slots`` [n],
        whose keys sit at positions at..at+n-1, with its keys moved to 0..n-1 (the form
        chunks are stored in)."""
        kv = read_pool_kv(self.pool, self.num_layers, slots.to(self.device))
        if at:
            self.rotate_in_place(kv[:, 0], -at)
        return kv

    def write_rotated(
        self,
        slots: torch.Tensor,  # [n]
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim], K at positions 0..n-1
        start: int,
    ) -> None:
        """Writes ``kv`` to ``slots`` with keys moved to positions start..start+n-1. The
        keys of ``kv`` are rotated in place, so pass a copy this request owns (``read``
        makes one): rotating them where they lie saves two copies of every layer's keys."""
        kv = kv.to(self.device)
        if start:
            self.rotate_in_place(kv[:, 0], start)
        write_pool_kv(self.pool, self.num_layers, slots.to(self.device), kv)

    def copy_rotated(
        self,
        src: torch.Tensor,  # [n] pool slots read; repeats allowed
        dst: torch.Tensor,  # [n] distinct pool slots written, none of them in ``src``
        delta: torch.Tensor,  # [n] positions each row's key moves by
    ) -> None:
        """Pool K/V at ``dst`` = those at ``src``, keys moved by ``delta``; ``src`` is only
        read, so a chunk node's KV stays as stored. Copies every device hit of a batch in
        one call, layer by layer and ``piece_rows`` rows at a time: the rows it stages (and
        the rotation's working copies) stay within ``staging_bytes`` however many tokens
        the batch reuses, since the pool already holds most of the device's memory
        (SGLang's ``mem_fraction_static``). Slots are checked against the pool once (one
        host read); nothing else here waits for the device.

        On the CPU, a layer's rows stay in cache from read to write (``bench/assembly.py``),
        and rows that run over consecutive slots on both sides with one ``delta`` (a chunk
        node's segment into the request's own slots, as a rule) are copied slice to slice,
        keys rotated straight into their new rows; finding those runs reads the indices
        on the host, which on a device would be a sync per batch, so there every row is
        gathered and scattered."""
        src = src.to(self.device, torch.int64)
        dst = dst.to(self.device, torch.int64)
        delta = delta.to(self.device, torch.int64)
        if src.numel() == 0:
            return
        rows = self.pool.get_key_buffer(0).shape[0]
        check_slots(((src, "src"), (dst, "dst")), rows)
        if self.per_layer_copies:
            runs, rest = slice_runs(src, dst, delta, self.slice_rows, self.piece_rows)
            self._copy_runs(runs)
            src, dst, delta = src[rest], dst[rest], delta[rest]
        spec = self.rope.spec
        inv_freq = None if spec.inv_freq is None else spec.inv_freq.to(self.device)
        for at in range(0, src.numel(), self.piece_rows):
            s, d = src[at : at + self.piece_rows], dst[at : at + self.piece_rows]
            shift = delta[at : at + self.piece_rows]
            # On the CPU each piece's angles are made once for every layer; elsewhere the
            # ops' kernel rotates the staged keys in place.
            angles = (
                rope_cos_sin(shift, inv_freq)
                if inv_freq is not None and self.per_layer_copies
                else None
            )
            for layer in range(self.num_layers):
                kb = self.pool.get_key_buffer(layer)
                vb = self.pool.get_value_buffer(layer)
                k = kb.index_select(0, s)
                if inv_freq is None:
                    k = self.rope.rotate(k, shift)
                elif angles is not None:
                    k = rotate_with(k, *angles, spec.layout)
                else:
                    apply_rope_kv_layer(k, shift, inv_freq, spec.layout)
                kb.index_copy_(0, d, k.to(kb.dtype))
                del k
                vb.index_copy_(0, d, vb.index_select(0, s))

    def _copy_runs(self, runs: list[SliceRun]) -> None:
        """``copy_rotated``'s runs, slice to slice in each layer (CPU pools only)."""
        if not runs:
            return
        spec = self.rope.spec
        # Each run's rotation, made once for every layer: the per-run work in the layer
        # loop is what a batch of small hits pays for.
        run_shifts: list[torch.Tensor] = []  # [rows] each, without a plain RoPE
        run_angles: list[tuple[torch.Tensor, torch.Tensor]] = []  # [1, head_dim // 2] each
        if spec.inv_freq is None:
            run_shifts = [torch.full((r.rows,), r.delta, device=self.device) for r in runs]
        else:
            shifts = torch.tensor([r.delta for r in runs], device=self.device)
            cos_all, sin_all = rope_cos_sin(shifts, spec.inv_freq)
            run_angles = [(cos_all[i : i + 1], sin_all[i : i + 1]) for i in range(len(runs))]
        for layer in range(self.num_layers):
            kb = self.pool.get_key_buffer(layer)
            vb = self.pool.get_value_buffer(layer)
            for i, r in enumerate(runs):
                s, d = slice(r.src, r.src + r.rows), slice(r.dst, r.dst + r.rows)
                vb[d].copy_(vb[s])
                if spec.inv_freq is None:
                    kb[d].copy_(self.rope.rotate(kb[s], run_shifts[i]))
                    continue
                cos, sin = run_angles[i]
                if kb.dtype == torch.float32:
                    rotate_with(kb[s], cos, sin, spec.layout, out=kb[d])
                else:
                    kb[d].copy_(rotate_with(kb[s], cos, sin, spec.layout))

    def checked(self, slots: torch.Tensor) -> torch.Tensor:  # [n] pool slots
        """# [n] int64 ``slots`` on the pool's device, checked to lie in the pool (one host
        read): what ``gather`` and ``scatter`` take, which check nothing themselves."""
        first = self.pool.get_key_buffer(0)
        return checked_rows(slots, first.shape[0], self.device)

    def gather(self, rows: torch.Tensor, layer: int, layer_end: int) -> torch.Tensor:
        """# [layer_end - layer, 2, n, num_kv_heads, head_dim] a copy of K and V of layers
        [layer, layer_end) at ``rows`` (# [n], from ``checked``), as ``read`` (unmoved)
        copies all layers: a piece of a chunk's KV, staged within a bound."""
        first = self.pool.get_key_buffer(0)
        out = torch.empty(
            (layer_end - layer, 2, rows.numel(), *first.shape[1:]),
            dtype=first.dtype,
            device=self.device,
        )
        for i, at in enumerate(range(layer, layer_end)):
            torch.index_select(self.pool.get_key_buffer(at), 0, rows, out=out[i, 0])
            torch.index_select(self.pool.get_value_buffer(at), 0, rows, out=out[i, 1])
        return out

    def scatter(
        self,
        rows: torch.Tensor,  # [n] distinct pool slots, from ``checked``
        kv: torch.Tensor,  # [layers, 2, n, num_kv_heads, head_dim] K then V
        layer: int,
    ) -> None:
        """Pool K and V of layers layer.. at ``rows`` = ``kv`` (cast to the pool's dtype),
        as ``write_pool_kv`` writes all layers."""
        for i in range(kv.shape[0]):
            kb = self.pool.get_key_buffer(layer + i)
            vb = self.pool.get_value_buffer(layer + i)
            kb.index_copy_(0, rows, kv[i, 0].to(kb.dtype))
            vb.index_copy_(0, rows, kv[i, 1].to(vb.dtype))

    def pre_rope_keys(self, kv: torch.Tensor) -> torch.Tensor:
        """# [num_layers, n, num_kv_heads, head_dim] the keys of a chunk's independent KV
        (``kv`` # [num_layers, 2, n, num_kv_heads, head_dim], keys at 0..n-1) un-rotated."""
        return self.rotated(kv[:, 0], -torch.arange(kv.shape[2], device=kv.device))

    def write_layer(
        self,
        layer: int,
        slots: torch.Tensor,  # [n]
        k: torch.Tensor,  # [n, num_kv_heads, head_dim], already at its final positions
        v: torch.Tensor,  # [n, num_kv_heads, head_dim]
    ) -> None:
        kb = self.pool.get_key_buffer(layer)
        vb = self.pool.get_value_buffer(layer)
        idx = slots.to(kb.device)
        kb[idx] = k.to(kb.device, kb.dtype)
        vb[idx] = v.to(vb.device, vb.dtype)

    def rotate_in_place(self, keys: torch.Tensor, delta: int | torch.Tensor) -> None:
        """keys # [L, n, H, D] (each layer contiguous) moved by ``delta`` positions (scalar
        or # [n]) where they lie: the op rotates a KV buffer in place, with no copy to
        rotate and copy back."""
        spec = self.rope.spec
        if spec.inv_freq is None:
            keys.copy_(self.rotated(keys, delta))
            return
        n = keys.shape[1]
        d = (
            torch.full((n,), delta, dtype=torch.int64, device=keys.device)
            if isinstance(delta, int)
            else delta
        )
        apply_rope_kv(keys, d, spec.inv_freq.to(keys.device), spec.layout)

    def rotated(self, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """keys # [L, n, H, D] rotated by ``delta`` positions (scalar or # [n])."""
        n = keys.shape[1]
        d = torch.full((n,), delta, device=keys.device) if isinstance(delta, int) else delta
        spec = self.rope.spec
        if spec.inv_freq is not None:
            return rotated_keys(keys, d, spec.inv_freq.to(keys.device), spec.layout)
        return self.rope.rotate(keys, d)
