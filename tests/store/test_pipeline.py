import threading
import time

import pytest
import torch

from sgl_pic.store.pipeline import PipelineConfig, run_layer_pipeline

L = 6


def test_inorder_runs_the_reference_order():
    order = []
    trace = run_layer_pipeline(
        3,
        lambda i: order.append(("load", i)) or i * 10,
        lambda i, y: order.append(("compute", i, y)),
        lambda i, x: order.append(("prepare", i)) or x + 1,
        PipelineConfig(mode="inorder"),
    )
    assert order == [
        ("load", 0), ("prepare", 0), ("compute", 0, 1),
        ("load", 1), ("prepare", 1), ("compute", 1, 11),
        ("load", 2), ("prepare", 2), ("compute", 2, 21),
    ]  # fmt: skip
    assert len(trace.events) == 9


@pytest.mark.parametrize("depth", [1, 2])
def test_threaded_prefetch_overlaps_compute_and_respects_dependencies(depth):
    load_started = [threading.Event() for _ in range(L)]
    saw_prefetch = []
    got = []

    def load(i):
        load_started[i].set()
        time.sleep(0.002)
        return torch.full((2,), float(i))

    def prepare(i, x):
        return x * 2

    def compute(i, y):
        got.append((i, y.tolist()))
        # Proof of overlap: compute(l) blocks until the transfer path has begun
        # layer l+1. An in-order schedule could never satisfy this.
        if i + 1 < L:
            saw_prefetch.append(load_started[i + 1].wait(5))
        time.sleep(0.002)

    cfg = PipelineConfig(mode="threaded", prefetch_depth=depth)
    trace = run_layer_pipeline(L, load, compute, prepare, cfg)
    assert saw_prefetch == [True] * (L - 1)
    assert got == [(i, [2.0 * i, 2.0 * i]) for i in range(L)]
    for i in range(L):
        ld, pr, co = (trace.span(s, i) for s in ("load", "prepare", "compute"))
        assert pr.start >= ld.end and co.start >= pr.end  # never before its data
        assert ld.thread == "pipeline-transfer" and pr.thread == "pipeline-recompute"
        if i > 0:
            # Recompute reads layer i-1's output.
            assert pr.start >= trace.span("compute", i - 1).end
        if i - depth >= 0:
            # Bounded prefetch: at most `depth` layers ahead of compute.
            assert ld.start >= trace.span("compute", i - depth).start
        if i + 1 < L:
            assert trace.span("load", i + 1).start < co.end  # overlap


@pytest.mark.parametrize("where", ["load", "prepare", "compute"])
def test_errors_propagate_without_hanging(where):
    def maybe_fail(stage, i):
        if stage == where and i == 3:
            raise RuntimeError(f"{stage} failed")

    def load(i):
        maybe_fail("load", i)

    def prepare(i, x):
        maybe_fail("prepare", i)

    def compute(i, y):
        maybe_fail("compute", i)

    cfg = PipelineConfig(mode="threaded", timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"{where} failed"):
        run_layer_pipeline(L, load, compute, prepare, cfg)
    assert time.monotonic() - t0 < 5
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_mode_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA"):
        run_layer_pipeline(1, lambda i: None, lambda i, y: None, None, PipelineConfig("cuda"))


def test_config_validation():
    with pytest.raises(ValueError, match="valid"):
        PipelineConfig(mode="async")
    with pytest.raises(ValueError):
        PipelineConfig(prefetch_depth=0)
    assert run_layer_pipeline(0, lambda i: None, lambda i, y: None).events == ()
