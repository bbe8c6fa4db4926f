"""``--pic-calibrate`` through the server: r per tier is measured, stored, exported and used."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from tests.support.prompts import body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

R_FLOOR = 0.3  # --pic-cachetune-r: the search's floor, distinct from the override below
R_FIXED = 0.15


def _expected_recomputed(toks: list[int], spans: list[list[int]], r: float) -> int:
    """What the executor recomputes for a cachetune request at ratio r (no device prefix):
    the count does not depend on the ranking's values, only on r and the layout."""
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.selection import SelectionContext, finalize, make_policy

    layout = PromptLayout.from_spans(len(toks), spans)
    rankings = tuple(torch.arange(s.length, dtype=torch.float32) for s in layout.chunks)
    policy = make_policy(PicConfig(policy="cachetune", cachetune_r=r))
    return int(finalize(policy.select(SelectionContext(layout, rankings)), layout).indices.numel())


def _recomputed(server: Server, req: dict) -> tuple[float, dict[str, float]]:
    before = server.metrics()
    r = server.generate(req)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["cached_tokens"] == 0
    after = server.metrics()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return delta["sgl_pic_recomputed_tokens_total"], delta


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    disk = tempfile.mkdtemp(prefix="sgl_pic_calib_")
    args = ("--pic-calibrate", "--pic-policy", "cachetune", "--pic-cachetune-r", str(R_FLOOR))
    with launch(*args, "--pic-disk-cache-dir", disk) as server:
        yield server, disk


def test_calibrated_r_is_stored_exported_and_used(served: tuple[Server, str]) -> None:
    server, disk = served
    stored = json.loads((Path(disk) / "calibration.json").read_text())
    assert set(stored["tiers"]) == {"host", "disk"}
    assert stored["r_min"] == R_FLOOR
    m = server.metrics()
    r_host = m['sgl_pic_calibrated_r{tier="host"}']
    assert r_host == pytest.approx(stored["tiers"]["host"]["r"])
    assert R_FLOOR <= r_host <= 1.0
    assert m['sgl_pic_calibrated_r{tier="device"}'] == pytest.approx(R_FLOOR)

    first = chunked(["A", "B", "C"], "Which city lies on the equator?", header="Ibis.\n")
    assert server.generate(body(*first)).status_code == 200  # computes the chunks

    # Chunk nodes are flushed with SGLang's tree; host memory keeps the chunks.
    requests.post(server.url + "/flush_cache?timeout=30", timeout=60).raise_for_status()
    toks, spans = chunked(["C", "A", "B"], "Where do rivers meet?", header="Heron.\n")
    got, d = _recomputed(server, body(toks, spans))
    assert d['sgl_pic_tier_hits_total{tier="host"}'] == 3
    assert got == _expected_recomputed(toks, spans, r_host)

    requests.post(server.url + "/flush_cache?timeout=30", timeout=60).raise_for_status()
    toks, spans = chunked(["B", "C", "A"], "Which city has temples?", header="Egret.\n")
    pinned = body(toks, spans, cachetune_r=R_FIXED)  # the request's own r wins
    got, d = _recomputed(server, pinned)
    assert d['sgl_pic_tier_hits_total{tier="host"}'] == 3
    assert got == _expected_recomputed(toks, spans, R_FIXED)
    assert got < _expected_recomputed(toks, spans, r_host)
    assert server.metrics()["sgl_pic_failures_total"] == 0


def test_cacheblend_loads_host_chunks_whole(served: tuple[Server, str]) -> None:
    server, _ = served
    toks, spans = chunked(["D", "E"], "Where is the midnight sun?", header="Stork.\n")
    assert server.generate(body(toks, spans)).status_code == 200  # computes the chunks
    requests.post(server.url + "/flush_cache?timeout=30", timeout=60).raise_for_status()
    toks, spans = chunked(["E", "D"], "Which port has funiculars?", header="Swan.\n")
    _, d = _recomputed(server, body(toks, spans, policy="cacheblend"))
    assert d['sgl_pic_tier_hits_total{tier="host"}'] == 2
    assert d["sgl_pic_failures_total"] == 0
    # CacheBlend compares against every reused token, so its chunks are loaded whole.
    assert 0 < d["sgl_pic_bytes_loaded_total"] == d["sgl_pic_bytes_dense_total"]


def test_calibration_waits_for_the_device_it_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA kernels run asynchronously: a timer that does not wait times their launch."""
    from sgl_pic.cli.calibrate import MatmulProxy, ModelShape, device_sync, time_call

    waits: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: waits.append(d))
    time_call(lambda: None, repeats=3, warmup=1, sync=device_sync("cuda:1"))
    assert waits == [torch.device("cuda:1")] * 6  # before and after each timed run
    waits.clear()
    time_call(lambda: None, repeats=3, sync=device_sync("cpu"))
    assert waits == []
    # The compute proxy lives on the device, in the model's dtype.
    proxy = MatmulProxy(ModelShape(), device="meta", dtype=torch.bfloat16)
    out = proxy(16)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == (16, 576)


def test_the_server_calibrates_on_the_pools_device_and_ranks_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each tensor-parallel rank gets rank 0's ratios (a two-rank sum over threads stands
    in for the all-reduce); only rank 0 measures, on the KV pool's device and dtype."""
    import threading
    from types import SimpleNamespace

    from sgl_pic.binding import calibration, tier_setup
    from sgl_pic.binding.settings import PicServerSettings
    from sgl_pic.config import PicConfig

    measured: list[tuple[int, str, torch.dtype]] = []

    def measure(settings: object, hf: object, device: str, dtype: torch.dtype) -> dict:
        measured.append((rank_of[threading.get_ident()], device, dtype))
        return {"device": 0.3, "host": 0.42, "disk": 0.61}

    monkeypatch.setattr(calibration, "_measure", measure)
    parts: list[torch.Tensor] = []
    barrier = threading.Barrier(2)

    def two_rank_sum(t: torch.Tensor) -> torch.Tensor:
        parts.append(t.clone())
        barrier.wait()
        total = parts[0] + parts[1]
        barrier.wait()
        return total

    monkeypatch.setattr(tier_setup, "tp_sum", two_rank_sum)
    settings = PicServerSettings(PicConfig(), host_cache_mb=4, calibrate=True)
    pool = SimpleNamespace(get_key_buffer=lambda _i: torch.zeros(4, 2, 8, dtype=torch.float16))
    rank_of: dict[int, int] = {}
    got: dict[int, dict[str, float]] = {}

    def rank(r: int) -> None:
        rank_of[threading.get_ident()] = r
        ctx = SimpleNamespace(tp_size=2, tp_rank=r)
        got[r] = tier_setup.calibrate_for_server(settings, None, pool, ctx)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert measured == [(0, "cpu", torch.float16)]
    assert got[0] == got[1] and got[0] == pytest.approx({"device": 0.3, "host": 0.42, "disk": 0.61})
