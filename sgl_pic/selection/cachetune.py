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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

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
) -> torch.Tensor:
    """Per-token recompute priority of one chunk (# [num_tokens] float32).

    k: # [num_layers, num_tokens, num_kv_heads, head_dim], pre-RoPE keys
    v: # [num_layers, num_tokens, num_kv_heads, head_dim_v]
    alpha: fraction of the lowest rFFT bins kept, in (0, 1].
    reduce: sums a tensor over tensor-parallel ranks, each of which holds some of the
        heads; with it every rank computes the ranking of all heads, so that all ranks
        select the same tokens (None: this rank holds every head).
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
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    num_layers, num_tokens = k.shape[:2]
    if num_layers == 0 or num_tokens == 0:
        raise ValueError(f"k and v need at least one layer and one token, got {tuple(k.shape)}")

    if reduce is None:
        magnitude = _low_pass_magnitude(k, alpha) + _low_pass_magnitude(v, alpha)  # [L, N]
    else:
        # The norm over heads x dims is the root of a sum over heads: sum the squares over
        # the ranks' heads first.
        magnitude = (
            reduce(_low_pass(k, alpha).square().sum(dim=2)).sqrt()
            + reduce(_low_pass(v, alpha).square().sum(dim=2)).sqrt()
        )
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
    num_layers, num_tokens = work.shape[:2]
    num_bins = num_tokens // 2 + 1
    keep = max(1, math.ceil(alpha * num_bins - 1e-9))
    flat = work.reshape(num_layers, num_tokens, -1)
    if keep < num_bins and num_tokens <= _PROJECTION_MAX_TOKENS:
        basis = _low_frequency_basis(num_tokens, keep, work.dtype, str(work.device))
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
