import pytest

from sgl_pic.store.cost_model import (
    CostParams,
    SearchConfig,
    balance_ratio,
    choose_ratio,
    golden_section,
    ttft,
)

PARAMS = CostParams(t_c=2e-6, t_i=1e-6, t_o=5e-5, num_layers=30, num_tokens=1000)


def test_ttft_is_the_per_layer_max_plus_overhead():
    # r = 0.2: compute 200 * 2us = 0.4 ms, load 800 * 1us = 0.8 ms -> load bound.
    assert ttft(PARAMS, 0.2) == pytest.approx(30 * (0.8e-3 + 5e-5))
    # r = 0.5: compute 1.0 ms, load 0.5 ms -> compute bound.
    assert ttft(PARAMS, 0.5) == pytest.approx(30 * (1.0e-3 + 5e-5))
    prologue = CostParams(2e-6, 1e-6, 5e-5, 30, 1000, include_prologue=True)
    assert ttft(prologue, 0.2) - ttft(PARAMS, 0.2) == pytest.approx(0.8e-3)
    with pytest.raises(ValueError):
        ttft(PARAMS, 1.5)


def test_balance_ratio_minimises_the_model():
    r_star = balance_ratio(PARAMS)
    assert r_star == pytest.approx(1 / 3)
    grid = [i / 1000 for i in range(1001)]
    best = min(grid, key=lambda r: ttft(PARAMS, r))
    assert abs(best - r_star) <= 1e-3
    # A fast tier puts the balance below the quality floor: the floor wins.
    fast = CostParams(t_c=2e-6, t_i=1e-8, t_o=0.0, num_layers=30, num_tokens=1000)
    assert balance_ratio(fast, r_min=0.15) == 0.15


@pytest.mark.parametrize("r_true", [0.15, 0.2, 0.37, 0.5, 0.81, 0.999, 1.0])
@pytest.mark.parametrize("warm", [None, 0.2, 0.9])
@pytest.mark.parametrize("tol", [1e-2, 1e-4])
def test_golden_section_finds_the_minimum_within_tolerance(r_true, warm, tol):
    calls = []

    def f(r):
        calls.append(r)
        return (r - r_true) ** 2 + 0.3

    cfg = SearchConfig(r_min=0.15, tol=tol, max_evals=200)
    res = golden_section(f, cfg, warm_start=warm)
    lo, hi = res.bracket
    assert hi - lo <= tol
    assert lo - 1e-12 <= r_true <= hi + 1e-12
    assert abs(res.r - r_true) <= tol / 2 + 1e-12
    assert len(calls) == len(set(calls)) == len(res.probes)  # no probe paid twice


def test_golden_section_on_the_piecewise_linear_ttft():
    for t_i in (1e-7, 5e-7, 1e-6, 4e-6, 2e-5):
        p = CostParams(t_c=1e-6, t_i=t_i, t_o=1e-5, num_layers=30, num_tokens=512)
        cfg = SearchConfig(r_min=0.15, tol=1e-3)
        res = choose_ratio(p, cfg)
        grid_best = min((0.15 + i * (0.85 / 20000) for i in range(20001)), key=lambda r: ttft(p, r))
        assert abs(res.r - grid_best) <= 1e-3
        assert res.r >= 0.15


def test_one_new_evaluation_per_golden_iteration_and_warm_start_saves_probes():
    def f(r):
        return abs(r - 0.42)

    cold = golden_section(f, SearchConfig(r_min=0.0, tol=1e-3, max_evals=200))
    # Width 1 to 1e-3 takes ceil(log(1e-3) / log(0.618)) = 15 shrinks: 2 + 15 probes.
    assert len(cold.probes) == 17
    warm = golden_section(
        f, SearchConfig(r_min=0.0, tol=1e-3, warm_width=0.02, max_evals=200), warm_start=0.43
    )
    assert abs(warm.r - 0.42) <= 5e-4 and abs(cold.r - 0.42) <= 5e-4
    assert len(warm.probes) < len(cold.probes)


def test_a_far_warm_start_still_brackets_the_minimum():
    res = golden_section(
        lambda r: (r - 0.95) ** 2, SearchConfig(r_min=0.15, tol=1e-3, warm_width=0.01), 0.16
    )
    assert abs(res.r - 0.95) <= 5e-4


def test_budget_is_honoured():
    calls = []
    res = golden_section(lambda r: calls.append(r) or r, SearchConfig(tol=1e-9, max_evals=5))
    assert len(calls) == 5 and res.best_r == min(calls)


def test_validation():
    with pytest.raises(ValueError):
        SearchConfig(r_min=0.5, r_max=0.4)
    with pytest.raises(ValueError):
        CostParams(t_c=-1.0, t_i=0.0, t_o=0.0, num_layers=1, num_tokens=1)
