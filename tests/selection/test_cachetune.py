import math

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.selection import SelectionContext, cachetune_ranking, make_policy
from sgl_pic.selection.cachetune import Slab, _low_pass_magnitude, slabs


def _kv(layers: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V, each # [layers, tokens, 2, 8]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, tokens, 2, 8, generator=g)
    return k, torch.randn(layers, tokens, 2, 8, generator=g)


def _order(score: torch.Tensor) -> list[int]:
    return torch.sort(score, descending=True, stable=True).indices.tolist()


def test_alpha_one_single_layer_ranks_by_plain_kv_norm() -> None:
    k, v = _kv(1, 33, seed=0)
    plain = k[0].flatten(1).norm(dim=1) + v[0].flatten(1).norm(dim=1)
    assert _order(cachetune_ranking(k, v, 1.0)) == _order(plain)


def test_alpha_one_multi_layer_ranks_by_normalised_plain_kv_norm() -> None:
    k, v = _kv(4, 40, seed=1)
    k = k * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(4, 1, 1, 1)  # very different scales
    plain = k.flatten(2).norm(dim=2) + v.flatten(2).norm(dim=2)
    z = (plain - plain.mean(1, keepdim=True)) / plain.std(1, correction=0, keepdim=True)
    score = cachetune_ranking(k, v, 1.0)
    assert _order(score) == _order(z.mean(0))
    assert torch.allclose(score, z.mean(0), atol=1e-5)


def test_low_frequency_signal_dominates_high_frequency_at_small_alpha() -> None:
    n = 64
    t = torch.arange(n, dtype=torch.float32)
    low = 2.0 + torch.cos(2 * math.pi * (t - 40) / n)  # slow bump peaking at token 40
    high = 4.0 * torch.cos(math.pi * t)  # +-4 alternating: the Nyquist bin
    k = (low + high).view(1, n, 1, 1)
    v = torch.zeros(1, n, 1, 1)
    # By plain magnitude the even tokens win; low-passed, the bump around 40 does.
    top_plain = set(_order(cachetune_ranking(k, v, 1.0))[:3])
    top_low = set(_order(cachetune_ranking(k, v, 0.5))[:3])
    assert all(i % 2 == 0 for i in top_plain)
    assert top_low == {39, 40, 41}


@pytest.mark.parametrize("tokens", [2, 7, 16, 61, 100, 513, 700])
@pytest.mark.parametrize("alpha", [0.01, 0.25, 0.6, 0.99])
def test_low_pass_equals_the_rfft_filter(tokens: int, alpha: float) -> None:
    # The definition: irfft of the spectrum with bins keep.. zeroed (float64).
    k, _ = _kv(3, tokens, tokens)
    x = k.double()
    keep = max(1, math.ceil(alpha * (tokens // 2 + 1) - 1e-9))
    spectrum = torch.fft.rfft(x, dim=1)
    spectrum[:, keep:] = 0
    expected = torch.fft.irfft(spectrum, n=tokens, dim=1).flatten(2).norm(dim=2)
    torch.testing.assert_close(_low_pass_magnitude(x, alpha), expected, rtol=1e-10, atol=1e-10)
    got32 = _low_pass_magnitude(k, alpha)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [40, 700])  # the projection and the FFT filter
def test_ranks_holding_some_heads_each_rank_all_heads_with_a_reduce(tokens: int) -> None:
    # Under tensor parallelism each rank holds some KV heads; ranks that ranked their own
    # heads alone would select different tokens and sum partial results of different rows.
    g = torch.Generator().manual_seed(3)
    k = torch.randn(3, tokens, 4, 8, generator=g)
    v = torch.randn(3, tokens, 4, 8, generator=g)
    whole = cachetune_ranking(k, v, 0.3)
    shards = [(k[:, :, :2], v[:, :, :2]), (k[:, :, 2:], v[:, :, 2:])]
    for me in (0, 1):
        other_k, other_v = shards[1 - me]
        # What the other rank hands the all-reduce, in call order.
        sent: list[torch.Tensor] = []
        cachetune_ranking(other_k, other_v, 0.3, reduce=lambda t, out=sent: out.append(t) or t)
        mine = cachetune_ranking(*shards[me], 0.3, reduce=lambda t, got=sent: t + got.pop(0))
        torch.testing.assert_close(mine, whole, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(cachetune_ranking(*shards[0], 0.3), whole, atol=1e-3)


def test_shapes_and_dtype() -> None:
    k = torch.randn(3, 17, 2, 4, dtype=torch.float16)
    v = torch.randn(3, 17, 2, 6, dtype=torch.float16)  # head dims may differ
    score = cachetune_ranking(k, v, 0.5)
    assert score.shape == (17,)
    assert score.dtype == torch.float32
    assert torch.isfinite(score).all()


def test_single_token_chunk() -> None:
    k, v = _kv(2, 1, seed=3)
    assert cachetune_ranking(k, v, 0.5).tolist() == [0.0]


def test_dc_only_spectrum_ranks_nothing() -> None:
    # Keeping only the DC bin leaves a constant per layer: no information, all zeros.
    k, v = _kv(2, 50, seed=4)
    assert torch.equal(cachetune_ranking(k, v, 0.01), torch.zeros(50))


@pytest.mark.parametrize(
    ("k_shape", "v_shape", "alpha", "match"),
    [
        ((2, 5, 1, 4), (2, 5, 1, 4), 0.0, "alpha"),
        ((2, 5, 1, 4), (2, 5, 1, 4), 1.5, "alpha"),
        ((2, 5, 4), (2, 5, 4), 0.5, "must be"),
        ((2, 5, 1, 4), (2, 6, 1, 4), 0.5, "disagree"),
        ((2, 0, 1, 4), (2, 0, 1, 4), 0.5, "at least one"),
    ],
)
def test_bad_inputs_raise(k_shape: tuple, v_shape: tuple, alpha: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cachetune_ranking(torch.zeros(k_shape), torch.zeros(v_shape), alpha)


# [chunk 0-10][fresh 10-12][chunk 12-32]
LAYOUT = PromptLayout.from_spans(34, [[0, 10], [12, 32]])


def _select(rankings: tuple, r: float = 0.15) -> list[int]:
    policy = make_policy(PicConfig(policy="cachetune", cachetune_r=r))
    return policy.select(SelectionContext(LAYOUT, rankings=rankings)).indices.tolist()


def test_policy_picks_top_r_of_every_chunk() -> None:
    first = torch.arange(10, dtype=torch.float32)  # best: 9, 8
    second = torch.zeros(20)
    second[[3, 17, 5, 11]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    # ceil(0.15 * 10) = 2 and ceil(0.15 * 20) = 3 (not 4 through 3.0000000000000004)
    assert _select((first, second)) == [8, 9, 12 + 3, 12 + 5, 12 + 17]


def test_policy_breaks_ties_by_lower_index() -> None:
    assert _select((torch.ones(10), torch.ones(20)), r=0.1) == [0, 12, 13]


def test_policy_r_one_selects_every_chunk_token() -> None:
    got = _select((torch.rand(10), torch.rand(20)), r=1.0)
    assert got == list(range(10)) + list(range(12, 32))


@pytest.mark.parametrize(
    ("rankings", "match"),
    [
        (None, "one ranking per chunk"),
        ((torch.rand(10),), "one ranking per chunk"),
        ((torch.rand(10), None), "chunk 1 \\[12, 32\\) has no cachetune ranking"),
        ((torch.rand(10), torch.rand(19)), "has 20 tokens"),
    ],
)
def test_policy_missing_or_wrong_ranking_raises(rankings: tuple | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _select(rankings)


def test_policy_uses_cachetune_ranking_end_to_end() -> None:
    rankings = tuple(cachetune_ranking(*_kv(2, s.length, seed=s.start), 0.5) for s in LAYOUT.chunks)
    got = _select(rankings)
    assert len([i for i in got if i < 10]) == 2
    assert len([i for i in got if 12 <= i < 32]) == 3


def _one_shot_ranking(k: torch.Tensor, v: torch.Tensor, alpha: float) -> torch.Tensor:
    """The ranking as one pass over the whole chunk computes it (the reference of the
    slabbed one): every layer's K and V low-passed at once, L2 norms over heads x dims,
    per-layer z-scores, mean over layers."""
    num_layers, num_tokens = k.shape[:2]
    keep = max(1, math.ceil(alpha * (num_tokens // 2 + 1) - 1e-9))

    def norm(x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x.double().reshape(num_layers, num_tokens, -1), dim=1)
        spectrum[:, keep:] = 0
        return torch.fft.irfft(spectrum, n=num_tokens, dim=1).norm(dim=2)

    magnitude = norm(k) + norm(v)
    mean = magnitude.mean(dim=1, keepdim=True)
    std = magnitude.std(dim=1, correction=0, keepdim=True)
    return ((magnitude - mean) / std).mean(dim=0).float()


@pytest.mark.parametrize("tokens", [40, 700])  # the projection and the FFT filter
@pytest.mark.parametrize("slab_elements", [None, 10**6, 3 * 700 * 16, 700 * 5, 1])
def test_the_slabbed_ranking_equals_the_one_shot_ranking(
    tokens: int, slab_elements: int | None
) -> None:
    """Slabs of whole layers, of columns of one layer, one column at a time: the same
    ranking up to float rounding, and the same top tokens."""
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(3, tokens, 2, 8, generator=g) * torch.rand(3, tokens, 1, 1, generator=g)
    v = torch.randn(3, tokens, 2, 8, generator=g)
    want = _one_shot_ranking(k, v, 0.3)
    got = cachetune_ranking(k, v, 0.3, slab_elements=slab_elements)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    count = tokens // 5
    assert set(_order(got)[:count]) == set(_order(want)[:count])


def test_slabs_cover_every_layer_and_unit_once_within_the_budget() -> None:
    for num_layers, width, unit, budget in [(3, 16, 40, 10**6), (3, 16, 40, 700), (3, 16, 40, 90)]:
        cells = [
            (layer, u)
            for s in slabs(num_layers, width, unit, budget)
            for layer in range(s.layer, s.layer_end)
            for u in range(s.start, s.end)
        ]
        assert sorted(cells) == [(i, u) for i in range(num_layers) for u in range(width)]
        sizes = [
            (s.layer_end - s.layer) * (s.end - s.start) * unit
            for s in slabs(num_layers, width, unit, budget)
        ]
        assert max(sizes) <= budget
    assert slabs(2, 4, 100, 1) == [Slab(i, i + 1, u, u + 1) for i in range(2) for u in range(4)]
