import json
import time
from types import SimpleNamespace

import pytest

from sgl_pic.cli import calibrate, calibrate_tiers, calibrate_timing
from sgl_pic.cli.calibrate_proxy import MatmulProxy, ModelShape
from sgl_pic.cli.calibrate_timing import per_token_cost
from sgl_pic.store.cost_model import SearchConfig


def test_per_token_cost_is_the_slope_not_the_fixed_cost(monkeypatch):
    # A clock that only ``run`` moves: real sleeps overrun by milliseconds on a loaded
    # machine, which is the whole slope here.
    now = [0.0]
    monkeypatch.setattr(calibrate_timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def run(n):
        now[0] += 0.004 + n * 2e-5  # 4 ms fixed, 20 us per token

    cost = per_token_cost(run, 10, 200, repeats=3)
    assert cost == pytest.approx(2e-5, rel=1e-6)


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


def test_loads_run_the_server_layer_feed_into_the_pool(tmp_path):
    """``tier_loader`` moves exactly n tokens per layer out of each tier through
    LowerTiers' placements and a LayerFeed, which writes them rotated into the pool."""
    import torch

    shape = ModelShape(num_layers=3, num_kv_heads=2, head_dim=8)
    row = shape.num_kv_heads * shape.head_dim * 4
    with calibrate.tier_chunks(tmp_path, shape, 24, segment_tokens=16) as chunks:
        assert set(chunks) == {"host", "disk"}
        assert chunks["host"][1] is None and chunks["disk"][1] is not None
        for tier, (chunk, cold) in chunks.items():
            assert chunk.lower.match(chunk.token_ids).tier == tier
            assert len(chunk.hit.keys) == 2  # 16 + 8 tokens, as the server segments them
            moved = calibrate.tier_loader(chunk, cold)(10)
            assert moved == shape.num_layers * 2 * 10 * row
            record = chunk.lower.load_full(chunk.hit, chunk.token_ids)
            for layer in range(shape.num_layers):
                k = chunk.pool.get_key_buffer(layer)
                torch.testing.assert_close(k[14:], record[layer, 0, 14:], atol=1e-5, rtol=0)
                assert torch.equal(chunk.pool.get_value_buffer(layer)[14:], record[layer, 1, 14:])
                # The recomputed rows (0..13) were not loaded: the pool's zeros remain.
                assert not k[:14].any()


def test_measured_objective_times_a_threaded_feed(tmp_path, monkeypatch):
    modes = []

    class Spy(calibrate_tiers.LayerFeed):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            modes.append(self.mode)

    monkeypatch.setattr(calibrate_tiers, "LayerFeed", Spy)
    computed = []
    res = calibrate.calibrate(
        tmp_path,
        ModelShape(num_layers=2),
        num_tokens=32,
        search=SearchConfig(r_min=0.2, tol=0.2),
        objective="measured",
        compute=lambda n: computed.append(n),
        repeats=1,
    )
    assert set(res.tiers) == {"host", "disk"} and res.objective == "measured"
    assert "threaded" in modes and "inorder" in modes  # the objective's and the loads'
    assert computed and all(1 <= n <= 32 for n in computed)
