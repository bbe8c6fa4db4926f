"""Reading and writing one request's KV across all layers of SGLang's token pool."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from sgl_pic.integration.model_rope import ModelRope
from sgl_pic.ops import apply_rope_kv, read_pool_kv, rotated_keys, write_pool_kv
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
) -> SliceRuns:
    """Maximal runs of rows whose source and destination slots both go up by one with one
    ``delta``; those of at least ``min_rows`` rows become ``SliceRun``s."""
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
            runs.append(SliceRun(src_l[i], dst_l[i], z - a, delta_l[i]))
        else:
            rest.append(torch.arange(a, z, device=src.device))
    return SliceRuns(runs, torch.cat(rest) if rest else src.new_empty(0))


class KVAccess:
    """pool: SGLang's MHATokenToKVPool (get_key_buffer / get_value_buffer per layer).
    rope: the model's own rotation (``model_rope``). Every tensor made here lives on the
    pool's device. Copies and rotations go through ``sgl_pic.ops`` (the CUDA kernels when
    the pool is on a GPU, the torch reference otherwise); a rotary table that is not plain
    whole-head RoPE (partial rotary, attention scaling) rotates through the table."""

    def __init__(self, pool: Any, num_layers: int, rope: ModelRope) -> None:
        self.pool = pool
        self.num_layers = num_layers
        self.rope = rope
        self.device = pool.get_key_buffer(0).device
        # How ``copy_rotated`` runs: layer by layer on the CPU (see there), through the
        # ops' all-layer kernels elsewhere.
        self.per_layer_copies = self.device.type == "cpu"
        # Shortest run of rows copied slice to slice there: a slice costs a few ops per
        # layer whatever its length, a gathered row a fixed share of one.
        self.slice_rows = SLICE_ROWS

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """# [num_layers, 2, n, num_kv_heads, head_dim] copy of the KV at ``slots`` [n]."""
        return read_pool_kv(self.pool, self.num_layers, slots.to(self.device))

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
            self._rotate_in_place(kv[:, 0], start)
        write_pool_kv(self.pool, self.num_layers, slots.to(self.device), kv)

    def copy_rotated(
        self,
        src: torch.Tensor,  # [n] pool slots read; repeats allowed
        dst: torch.Tensor,  # [n] distinct pool slots written, none of them in ``src``
        delta: torch.Tensor,  # [n] positions each row's key moves by
    ) -> None:
        """Pool K/V at ``dst`` = those at ``src``, keys moved by ``delta``; ``src`` is only
        read, so a chunk node's KV stays as stored. Copies every device hit of a batch in
        one call. On the CPU it runs one layer at a time, so that a layer's rows stay in
        cache from read to write, where ``read``, a rotation of every layer's keys and the
        write each stream all layers through memory (``bench/assembly.py`` times both).
        There, rows that run over consecutive slots on both sides with one ``delta`` (a
        chunk node's segment into the request's own slots, as a rule) are copied slice to
        slice, keys rotated straight into their new rows; the rest are gathered and
        scattered."""
        src = src.to(self.device, torch.int64)
        dst = dst.to(self.device, torch.int64)
        delta = delta.to(self.device, torch.int64)
        if not self.per_layer_copies:
            kv = self.read(src)
            self._rotate_in_place(kv[:, 0], delta)
            write_pool_kv(self.pool, self.num_layers, dst, kv)
            return
        runs, rest = slice_runs(src, dst, delta, self.slice_rows)
        spec = self.rope.spec
        rest_src, rest_dst, rest_delta = src[rest], dst[rest], delta[rest]
        # Each run's rotation, made once for every layer: the per-run work in the layer
        # loop is what a batch of small hits pays for.
        run_shifts: list[torch.Tensor] = []  # [rows] each, without a plain RoPE
        run_angles: list[tuple[torch.Tensor, torch.Tensor]] = []  # [1, head_dim // 2] each
        if spec.inv_freq is None:
            rest_angles = None
            run_shifts = [delta.new_full((r.rows,), r.delta) for r in runs]
        else:
            shifts = torch.tensor([r.delta for r in runs], device=self.device)
            cos_all, sin_all = rope_cos_sin(shifts, spec.inv_freq)
            run_angles = [(cos_all[i : i + 1], sin_all[i : i + 1]) for i in range(len(runs))]
            rest_angles = rope_cos_sin(rest_delta, spec.inv_freq)
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
            if rest.numel():
                k = kb.index_select(0, rest_src)
                if rest_angles is None:
                    k = self.rope.rotate(k, rest_delta)
                else:
                    k = rotate_with(k, *rest_angles, spec.layout)
                kb.index_copy_(0, rest_dst, k)
                vb.index_copy_(0, rest_dst, vb.index_select(0, rest_src))

    def pre_rope_keys(self, kv: torch.Tensor) -> torch.Tensor:
        """# [num_layers, n, num_kv_heads, head_dim] the keys of a chunk's independent KV
        (``kv`` # [num_layers, 2, n, num_kv_heads, head_dim], keys at 0..n-1) un-rotated."""
        return self._rotate(kv[:, 0], -torch.arange(kv.shape[2], device=kv.device))

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

    def _rotate_in_place(self, keys: torch.Tensor, delta: int | torch.Tensor) -> None:
        """keys # [L, n, H, D] (each layer contiguous) moved by ``delta`` positions (scalar
        or # [n]) where they lie: the op rotates a KV buffer in place, with no copy to
        rotate and copy back."""
        spec = self.rope.spec
        if spec.inv_freq is None:
            keys.copy_(self._rotate(keys, delta))
            return
        n = keys.shape[1]
        d = (
            torch.full((n,), delta, dtype=torch.int64, device=keys.device)
            if isinstance(delta, int)
            else delta
        )
        apply_rope_kv(keys, d, spec.inv_freq.to(keys.device), spec.layout)

    def _rotate(self, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """keys # [L, n, H, D] rotated by ``delta`` positions (scalar or # [n])."""
        n = keys.shape[1]
        d = torch.full((n,), delta, device=keys.device) if isinstance(delta, int) else delta
        spec = self.rope.spec
        if spec.inv_freq is not None:
            return rotated_keys(keys, d, spec.inv_freq.to(keys.device), spec.layout)
        return self.rope.rotate(keys, d)
