"""bench/soak_sampler.py: /metrics parsed into the sampled series, the trend of a series
after warm-up (slope, last against first, growth flagged over 5%), and /proc read for a
process group."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def sampler() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the soak's modules import each other by bare name
    try:
        yield importlib.import_module("soak_sampler")
    finally:
        sys.path.remove(str(BENCH))


METRICS = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="m",tp_rank="0"} 0.25
sglang:num_used_tokens{model_name="m",tp_rank="0"} 300.0
sglang:num_used_tokens{model_name="m",tp_rank="1"} 100.0
sgl_pic_chunk_node_tokens 512.0
sgl_pic_namespace_tier_bytes{namespace="ab12",tier="host"} 1000.0
sgl_pic_namespace_tier_bytes{namespace="other",tier="host"} 24.0
sgl_pic_namespace_tier_bytes{tier="disk",namespace="ab12"} 4096.0
sgl_pic_selection_seconds_bucket{le="0.1"} 3.0
sgl_pic_selection_seconds_count 3.0
garbage line
"""


def test_parse_metrics(sampler: ModuleType) -> None:
    m = sampler.parse_metrics(METRICS)
    assert m["sgl_pic_chunk_node_tokens"] == 512.0
    assert m['sglang:num_used_tokens{model_name="m",tp_rank="1"}'] == 100.0
    assert m["sgl_pic_selection_seconds_count"] == 3.0
    assert not any("_bucket" in k or k.startswith("#") for k in m)
    assert "garbage" not in m


def test_group_sums_sum_over_labels(sampler: ModuleType) -> None:
    got = sampler.group_sums(sampler.parse_metrics(METRICS))
    assert got["kv_token_usage"] == 0.25
    assert got["kv_used_tokens"] == 400.0
    assert got["chunk_node_tokens"] == 512.0
    # Label order as the exporter wrote it does not matter.
    assert got["host_tier_bytes"] == 1024.0 and got["disk_tier_bytes"] == 4096.0
    # Series the server did not export are absent, not 0 (the tier gauges read 0).
    assert "running_reqs" not in got
    assert sampler.group_sums({})["host_tier_bytes"] == 0.0


def test_trend_slope_growth_and_flag(sampler: ModuleType) -> None:
    flat = sampler.trend([(0.0, 100.0), (60.0, 103.0), (120.0, 104.0)], bounded=True)
    assert flat.first == 100.0 and flat.last == 104.0
    assert flat.growth == pytest.approx(0.04) and not flat.grows
    assert flat.slope_per_min == pytest.approx(2.0)
    rising = sampler.trend([(0.0, 100.0), (60.0, 106.0)], bounded=True)
    assert rising.grows and rising.slope_per_min == pytest.approx(6.0)
    # The same rise in a series that follows the load is reported, not flagged.
    assert not sampler.trend([(0.0, 100.0), (60.0, 106.0)], bounded=False).grows
    # From nothing to something is growth; nothing throughout is not.
    assert sampler.trend([(0.0, 0.0), (1.0, 5.0)], bounded=True).grows
    zero = sampler.trend([(0.0, 0.0), (1.0, 0.0)], bounded=True)
    assert zero.growth is None and not zero.grows
    assert sampler.trend([(0.0, 1.0)], bounded=True) is None


def test_trends_per_launch_after_warmup(sampler: ModuleType) -> None:
    S = sampler.Sample
    samples = [
        S(10.0, "a", 1, {"rss_bytes": 999.0}),  # in warm-up
        S(40.0, "a", 1, {"rss_bytes": 100.0, "kv_token_usage": 0.1}),
        S(70.0, "a", 1, {"rss_bytes": 110.0, "kv_token_usage": 0.9}),
        S(80.0, "a", 2, {"rss_bytes": 50.0}),  # the restarted launch, in its warm-up
        S(120.0, "a", 2, {"rss_bytes": 60.0}),
        S(150.0, "a", 2, {"rss_bytes": 60.0}),
        S(150.0, "c", 1, {"rss_bytes": 1.0}),  # no known start: left out
    ]
    got = sampler.trends(samples, {("a", 1): 0.0, ("a", 2): 75.0}, warmup_s=30.0)
    assert set(got) == {"a#1", "a#2"}
    assert got["a#1"]["rss_bytes"]["first"] == 100.0
    assert got["a#1"]["rss_bytes"]["grows"] is True
    assert got["a#1"]["kv_token_usage"]["grows"] is False
    assert got["a#2"]["rss_bytes"]["n"] == 2 and got["a#2"]["rss_bytes"]["grows"] is False


def test_capped_series_may_fill_to_their_cap_and_the_rest_are_judged_once_full(
    sampler: ModuleType,
) -> None:
    S = sampler.Sample
    samples = [
        S(40.0, "a", 1, {"chunk_node_tokens": 10.0, "rss_bytes": 100.0, "fds": 10.0}),
        S(70.0, "a", 1, {"chunk_node_tokens": 96.0, "rss_bytes": 130.0, "fds": 10.0}),
        S(100.0, "a", 1, {"chunk_node_tokens": 100.0, "rss_bytes": 131.0, "fds": 10.0}),
        S(130.0, "a", 1, {"chunk_node_tokens": 99.0, "rss_bytes": 133.0, "fds": 12.0}),
    ]
    got = sampler.trends(samples, {("a", 1): 0.0}, 30.0, {"chunk_node_tokens": 100.0})["a#1"]
    # Filled tenfold to its cap and never past it: bounded.
    assert got["chunk_node_tokens"]["grows"] is False and got["chunk_node_tokens"]["cap"] == 100
    # RSS rose while the cache filled; from the cache full (t=70) on, within 5%.
    assert got["rss_bytes"]["since_t"] == 70.0 and got["rss_bytes"]["grows"] is False
    assert got["fds"]["grows"] is True  # 10 -> 12 once full
    over = [
        S(40.0, "a", 1, {"chunk_node_tokens": 10.0}),
        S(70.0, "a", 1, {"chunk_node_tokens": 101.0}),
    ]
    got = sampler.trends(over, {("a", 1): 0.0}, 30.0, {"chunk_node_tokens": 100.0})["a#1"]
    assert got["chunk_node_tokens"]["grows"] is True
    # Never full: judged from warm-up, as without caps.
    never = [
        S(40.0, "a", 1, {"chunk_node_tokens": 10.0, "rss_bytes": 100.0}),
        S(70.0, "a", 1, {"chunk_node_tokens": 20.0, "rss_bytes": 130.0}),
    ]
    got = sampler.trends(never, {("a", 1): 0.0}, 30.0, {"chunk_node_tokens": 100.0})["a#1"]
    assert got["rss_bytes"]["since_t"] is None and got["rss_bytes"]["grows"] is True


def test_process_group_reads_this_process(sampler: ModuleType) -> None:
    pgid = os.getpgid(0)
    assert os.getpid() in sampler.group_pids(pgid)
    got = sampler.process_group(pgid)
    assert got["processes"] >= 1 and got["rss_bytes"] > 0 and got["threads"] >= 1
    assert got["fds"] >= 3 and got["max_process_rss_bytes"] <= got["rss_bytes"]


def test_dir_bytes(sampler: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_bytes(b"1" * 100)
    (tmp_path / "g").write_bytes(b"1" * 23)
    assert sampler.dir_bytes(tmp_path) == 123.0
