"""CacheTune's offline frequency-guided ranking (Section 4.1, Appendix B.1) and policy.

When a chunk's KV is generated, its positions are ranked once:

1. per layer, rFFT of K and of V along the token axis (every head and channel is a
   sequence of N tokens), keeping the lowest ceil(alpha * (N // 2 + 1)) bins;
2. inverse rFFT to length N: a low-frequency K and V aligned with the positions
   (computed as the equal orthogonal projection onto the kept frequencies);
3. per token, the L2 magnitude of the low-frequency K and of V over heads x dims,
   added with equal weights;
4. per layer, a z-score (subtract the layer's mean over tokens, divide by its
   standard deviation). The paper only says the scores are normalised "within each
   layer" to make layer scales comparable; the z-score does exactly that and, unlike
   dividing by the maximum, is not dominated by one attention-sink outlier. A layer
   whose scores are all equal carries no ranking information and contributes 0;
5. mean over layers: one score per token, higher = recompute first.

Keys are ranked before RoPE: CacheTune stores pre-RoPE keys (Section 4.2, deferred
RoPE) and ranks at cache generation, and a ranking that should hold wherever the chunk
is placed must not depend on a rotation by position. (RoPE rotates each pair of
channels, so it leaves per-token norms unchanged, but it modulates the sequence along
the tokens and would move energy across frequency bins.)

With alpha = 1 every bin is kept and the filter is skipped, so the ranking equals the
one of step 3-5 applied to the plain K/V norms (the paper notes the reduction).

Steps 1-3 are one filter per column (a layer's head and channel: the low pass is the
orthogonal projection of its N values onto the kept bins) and a sum of squares over
columns, so the columns can be taken in slabs (``slabs``, ``LowPassEnergy``): a long
chunk is ranked holding one slab of columns at a time, plus # [2, num_layers, N] of
per-token energy, never the whole chunk's K and V; the ranking is the same up to float
rounding (phase 1 ranks from the pool so, ``engine.chunk_store``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from sgl_pic.selection.base import (
    Selection,
    SelectionContext,
    SelectionPolicy,
    as_selection,
    ceil_fraction,
)
from sgl_pic.selection.registry import register_policy


def cachetune_ranking(
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: float,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    slab_elements: int | None = None,
) -> torch.Tensor:
    """Per-token recompute priority of one chunk (# [num_tokens] float32).

    k: # [num_layers, num_tokens, num_kv_heads, head_dim], pre-RoPE keys
    v: # [num_layers, num_tokens, num_kv_heads, head_dim_v]
    alpha: fraction of the lowest rFFT bins kept, in (0, 1].
    reduce: sums a tensor over tensor-parallel ranks, each of which holds some of the
        heads; with it every rank computes the ranking of all heads, so that all ranks
        select the same tokens (None: this rank holds every head).
    slab_elements: most elements of ``k`` or ``v`` filtered at once (``slabs``);
        None: all of them. The ranking is the same up to float rounding either way.
    """
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "k and v must be [num_layers, num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v disagree on [num_layers, num_tokens]: {tuple(k.shape[:2])} vs "
            f"{tuple(v.shape[:2])}"
        )
    num_layers, num_tokens = k.shape[:2]
    energy = LowPassEnergy(num_layers, num_tokens, alpha, k.device, k.dtype)
    for which, x in enumerate((k, v)):
        flat = x.reshape(num_layers, num_tokens, -1)
        budget = flat.numel() if slab_elements is None else slab_elements
        for s in slabs(num_layers, flat.shape[2], num_tokens, budget):
            energy.add(which, s.layer, flat[s.layer : s.layer_end, :, s.start : s.end])
    return energy.ranking(reduce)


class Slab(NamedTuple):
    """Layers [layer, layer_end) and units [start, end) of one slab (``slabs``)."""

    layer: int
    layer_end: int
    start: int
    end: int


def slabs(num_layers: int, width: int, unit: int, budget: int) -> list[Slab]:
    """Slabs covering every (layer, unit) of a chunk, ``width`` units per layer of ``unit``
    elements (or bytes) each, at most ``budget`` per slab: all layers at once while they
    fit, else blocks of whole layers, else one layer in blocks of units (one at least,
    whatever the budget). A unit: every token of one column, for a ranking; one row of
    a layer, for a copy."""
    layer_size = width * unit
    if layer_size * num_layers <= budget:
        return [Slab(0, num_layers, 0, width)]
    if layer_size <= budget:
        step = budget // layer_size
        return [Slab(at, min(at + step, num_layers), 0, width) for at in range(0, num_layers, step)]
    step = max(1, budget // unit)
    return [
        Slab(layer, layer + 1, at, min(at + step, width))
        for layer in range(num_layers)
        for at in range(0, width, step)
    ]


class LowPassEnergy:
    """A chunk's ranking built slab by slab: each slab of K or V columns (every token of
    some channels in some layers) is low-passed along the tokens on its own (the filter
    is one per column) and its squares are summed into the per-token energy of its layers,
    # [2, num_layers, num_tokens]; ``ranking`` then takes the roots, z-scores and layer
    mean of ``cachetune_ranking``. That energy is the only state kept across slabs, so the
    largest temporary is a slab's (with its spectrum), however long the chunk."""

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        alpha: float,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if num_layers == 0 or num_tokens == 0:
            raise ValueError(
                "k and v need at least one layer and one token, got "
                f"{num_layers} layers and {num_tokens} tokens"
            )
        self.alpha = alpha
        self.num_tokens = num_tokens
        # FFTs of half precision are limited on CPU and lossy; float64 stays float64.
        self.dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.energy = torch.zeros(2, num_layers, num_tokens, dtype=self.dtype, device=device)

    def add(
        self,
        which: int,
        layer: int,
        columns: torch.Tensor,  # [layers, num_tokens, num_columns] of K (0) or V (1)
    ) -> None:
        """Adds the low-passed squares of ``columns`` (layers layer.. of ``which``)."""
        if columns.shape[1] != self.num_tokens:
            raise ValueError(f"{columns.shape[1]} tokens in a slab of {self.num_tokens}")
        low = _low_pass_flat(columns.to(self.dtype), self.alpha)
        self.energy[which, layer : layer + columns.shape[0]] += low.square().sum(dim=2)

    def ranking(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """# [num_tokens] float32 once every column was added; ``reduce`` as in
        ``cachetune_ranking``: the norm over heads x dims is the root of a sum over heads,
        so the squares are summed over the ranks first (K's, then V's)."""
        k_energy, v_energy = self.energy[0], self.energy[1]
        if reduce is not None:
            k_energy, v_energy = reduce(k_energy), reduce(v_energy)
        magnitude = k_energy.sqrt() + v_energy.sqrt()  # [L, N]
        return _standardise(magnitude).mean(dim=0).to(torch.float32)


def ranking_recipe(alpha: float) -> str:
    """Names how ``cachetune_ranking`` ranked a stored chunk: the part of a store's key
    (``ModelFingerprint.ranking``) that keeps rankings made with another alpha apart."""
    return f"cachetune_alpha={float(alpha)!r}"


def top_ranked(ranking: torch.Tensor, count: int) -> torch.Tensor:
    """Local indices of the ``count`` highest scores (# [count] int64, sorted),
    ties going to the lower index.

    ranking: # [num_tokens] float
    """
    # A stable descending sort keeps equal scores in index order.
    order = torch.sort(ranking, descending=True, stable=True).indices
    return torch.sort(order[:count]).values


@register_policy
class CacheTune(SelectionPolicy):
    """Top ceil(cachetune_r * len) tokens of every chunk by its stored offline ranking."""

    name = "cachetune"
    needs_ranking = True

    def select(self, ctx: SelectionContext) -> Selection:
        chunks = ctx.layout.chunks
        rankings = ctx.rankings
        if rankings is None or len(rankings) != len(chunks):
            got = "none" if rankings is None else str(len(rankings))
            raise ValueError(
                f"cachetune needs one ranking per chunk ({len(chunks)}), got {got}; "
                "rankings are computed with cachetune_ranking when a chunk is cached"
            )
        picked: list[torch.Tensor] = []
        for i, (span, ranking) in enumerate(zip(chunks, rankings, strict=True)):
            if ranking is None:
                raise ValueError(
                    f"chunk {i} [{span.start}, {span.end}) has no cachetune ranking; it "
                    "must be computed with cachetune_ranking when the chunk is cached"
                )
            if ranking.dim() != 1 or ranking.numel() != span.length:
                raise ValueError(
                    f"chunk {i} [{span.start}, {span.end}) has {span.length} tokens but "
                    f"its ranking has shape {tuple(ranking.shape)}"
                )
            count = ceil_fraction(self.config.cachetune_r, span.length)
            picked.append(top_ranked(ranking.detach().cpu(), count) + span.start)
        return as_selection(torch.cat(picked) if picked else [])


def _low_pass_magnitude(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-token L2 norm over heads x dims of the low-frequency part of ``x``
    (# [num_layers, num_tokens] float).

    x: # [num_layers, num_tokens, num_heads, head_dim]
    """
    return _low_pass(x, alpha).norm(dim=2)


def _low_pass(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The low-frequency part of ``x`` along the tokens, heads x dims flattened
    (# [num_layers, num_tokens, num_heads * head_dim] float).

    x: # [num_layers, num_tokens, num_heads, head_dim]
    """
    # FFTs of half precision are limited on CPU and lossy; float64 stays float64.
    work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return _low_pass_flat(work.reshape(*work.shape[:2], -1), alpha)


def _low_pass_flat(flat: torch.Tensor, alpha: float) -> torch.Tensor:
    """The low-frequency part of every column of ``flat`` along the tokens
    (# [num_layers, num_tokens, num_columns], float32 or float64 as ``flat``)."""
    num_tokens = flat.shape[1]
    num_bins = num_tokens // 2 + 1
    keep = max(1, math.ceil(alpha * num_bins - 1e-9))
    if keep < num_bins and num_tokens <= _PROJECTION_MAX_TOKENS:
        basis = _low_frequency_basis(num_tokens, keep, flat.dtype, str(flat.device))
        flat = torch.matmul(basis, torch.matmul(basis.T, flat))
    elif keep < num_bins:
        spectrum = torch.fft.rfft(flat, dim=1)
        spectrum[:, keep:] = 0
        flat = torch.fft.irfft(spectrum, n=num_tokens, dim=1)
    return flat


# The projection costs ~alpha * N^2 per channel against the FFTs' ~N log N: measured on
# this CPU it is the faster up to ~1k tokens and the slower at 2k. Past this length (or a
# basis above 0.5 MiB at alpha 0.5) the FFTs run.
_PROJECTION_MAX_TOKENS = 512


@functools.lru_cache(maxsize=64)
def _low_frequency_basis(
    num_tokens: int, keep: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    """# [num_tokens, 2 * keep - 1] orthonormal columns spanning the real sequences of
    rFFT bins 0..keep-1 (keep < num_tokens // 2 + 1, so the Nyquist bin is never kept).

    irfft(rfft(x) with bins keep.. zeroed) is the orthogonal projection of x onto them,
    so ``basis @ basis.T @ x`` is that low-pass filter. On a CPU two small matmuls cost
    about a fifth of the two FFTs, which also plan afresh for every new length (1.5 ms
    against 7 ms per tensor, chunks of 60-160 tokens of the embedded model, one thread)."""
    t = torch.arange(num_tokens, dtype=torch.float64)
    cols = [torch.full((num_tokens,), 1 / math.sqrt(num_tokens), dtype=torch.float64)]
    for k in range(1, keep):
        angle = (2 * math.pi * k / num_tokens) * t
        cols += [torch.cos(angle) * math.sqrt(2 / num_tokens)]
        cols += [torch.sin(angle) * math.sqrt(2 / num_tokens)]
    return torch.stack(cols, dim=1).to(dtype=dtype, device=device)


def _standardise(magnitude: torch.Tensor) -> torch.Tensor:
    """Per-layer z-score (# [num_layers, num_tokens]).

    magnitude: # [num_layers, num_tokens] float, >= 0
    """
    mean = magnitude.mean(dim=1, keepdim=True)
    std = magnitude.std(dim=1, correction=0, keepdim=True)
    # A layer whose spread is at the level of FFT round-off (e.g. only the DC bin kept)
    # is constant: dividing would rank noise, so it contributes 0 instead.
    noise = 64 * torch.finfo(magnitude.dtype).eps * mean.abs()
    flat = std <= noise
    z = (magnitude - mean) / torch.where(flat, torch.ones_like(std), std)
    return z.masked_fill(flat, 0.0)
