import json
import time

import pytest

from sgl_pic import calibrate
from sgl_pic.calibrate import MatmulProxy, ModelShape, per_token_cost
from sgl_pic.store.cost_model import SearchConfig


def test_per_token_cost_is_the_slope_not_the_fixed_cost():
    def run(n):
        time.sleep(0.004 + n * 2e-5)  # 4 ms fixed, 20 us per token

    cost = per_token_cost(run, 10, 200, repeats=3)
    assert cost == pytest.approx(2e-5, rel=0.5)


def test_proxy_shape():
    shape = ModelShape()
    assert MatmulProxy(shape)(7).shape == (7, shape.hidden)


def test_calibrate_small_run_with_a_supplied_compute(tmp_path):
    shape = ModelShape(num_layers=4)
    res = calibrate.calibrate(
        tmp_path,
        shape,
        num_tokens=64,
        search=SearchConfig(r_min=0.15, tol=0.05),
        compute=lambda n: time.sleep(n * 1e-6),
        repeats=1,
    )
    assert set(res.tiers) == {"host", "disk"}
    for tier in res.tiers.values():
        assert 0.15 <= tier.r <= 1.0 and tier.t_i >= 0 and tier.probes >= 3
    assert res.compute_source == "supplied"
    assert list(tmp_path.iterdir()) == []  # the scratch disk tier is cleaned up


def test_cli_writes_json(tmp_path, capsys):
    assert calibrate.main(["--cache-dir", str(tmp_path), "--tokens", "32", "--repeats", "1"]) == 0
    data = json.loads((tmp_path / calibrate.RESULT_FILE).read_text())
    assert data["compute_source"].startswith("matmul proxy")
    assert data["shape"]["num_layers"] == 30 and data["shape"]["num_kv_heads"] == 3
    assert set(data["tiers"]) == {"host", "disk"}
    out = capsys.readouterr().out
    assert "chosen r" in out and "proxy" in out
