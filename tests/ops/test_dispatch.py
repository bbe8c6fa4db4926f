"""The public ops: backend choice, results equal to the reference on CPU tensors, and
the fallbacks to torch on a GPU (faked) whose kernels were not prepared or fail."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import sgl_pic.ops as ops
from sgl_pic.ops import cuda, reference
from sgl_pic.rope import default_inv_freq
from tests.ops.fake_cuda import INSUFFICIENT_DRIVER, FakeLib, fake_gpu


def test_cpu_tensors_run_the_reference(rand_kv, distinct, gen) -> None:
    src = rand_kv(2, 30, 3, 64, dtype=torch.bfloat16)
    pool = rand_kv(2, 40, 3, 64, dtype=torch.bfloat16)
    tokens, slots = distinct(20, 30), distinct(20, 40)
    positions = torch.randint(0, 10_000, (20,), generator=gen)
    inv_freq = default_inv_freq(64, 10000.0)

    expected = pool.clone()
    reference.gather_kv(src, tokens, expected, slots)
    reference.apply_rope_kv(expected, positions, inv_freq, "interleaved", slot_ids=slots)

    got = list(pool.clone().unbind(0))
    assert ops.gather_kv(src, tokens, got, slots) == ops.OpResult("reference")
    result = ops.apply_rope_kv(got, positions, inv_freq, "interleaved", slot_ids=slots)
    assert result.backend == "reference"
    assert torch.equal(torch.stack(got), expected)


def test_cuda_status_is_a_reason_not_an_error() -> None:
    state = ops.cuda_status()
    assert isinstance(state, ops.CudaStatus)
    if not torch.cuda.is_available():
        assert not state.available
        assert "no CUDA device" in state.reason


def test_import_needs_no_nvcc_and_builds_nothing() -> None:
    code = (
        "import sgl_pic, sgl_pic.ops, sgl_pic.ops.cuda as c; "
        "assert c._KERNELS.status is None and c._KERNELS.lib is None; "
        "assert not c.status().available"
    )
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "op",
    [ops.gather_kv, ops.gather_kv_layer, ops.scatter_kv, ops.scatter_kv_layer],
)
def test_copy_ops_share_reference_signature(op) -> None:
    import inspect

    assert inspect.signature(op) == inspect.signature(getattr(reference, op.__name__))


@pytest.mark.parametrize(
    "op",
    [ops.apply_rope_kv, ops.apply_rope_kv_layer, ops.rerotate_kv, ops.rerotate_kv_layer],
)
def test_rope_ops_share_reference_signature(op) -> None:
    import inspect

    assert inspect.signature(op) == inspect.signature(getattr(reference, op.__name__))


def test_errors_name_the_arguments_as_written(rand_kv) -> None:
    k = rand_kv(2, 10, 3, 64, dtype=torch.float32)
    inv_freq = default_inv_freq(64, 10000.0)
    ok, short = torch.arange(10), torch.arange(9)
    for module in (ops, reference):
        with pytest.raises(ValueError, match="new_positions"):
            module.rerotate_kv(k, ok, short, inv_freq)
        with pytest.raises(ValueError, match="old_positions"):
            module.rerotate_kv_layer(k[0], short, ok, inv_freq)
        with pytest.raises(ValueError, match="^positions"):
            module.apply_rope_kv(k, short, inv_freq)


def _gather_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    src, pool = torch.randn(2, 8, 2, 64, generator=g), torch.randn(2, 16, 2, 64, generator=g)
    return src, torch.tensor([1, 6, 2]), pool, torch.tensor([3, 4, 12])


def _as_if_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU tensors stand in for device ones: the ops ask cuda whether the kernels take them.
    monkeypatch.setattr(cuda, "can_copy", lambda plan: True)
    monkeypatch.setattr(cuda, "can_rope", lambda plan: True)


def test_gpu_ops_before_prepare_run_torch_and_build_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    builds = fake_gpu(monkeypatch, FakeLib())
    _as_if_on_the_gpu(monkeypatch)
    src, tokens, pool, slots = _gather_case()
    expected = pool.clone()
    reference.gather_kv(src, tokens, expected, slots)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert ops.gather_kv(src, tokens, pool, slots).backend == "reference"
            k = pool.clone()
            assert ops.apply_rope_kv(k, torch.arange(16), default_inv_freq(64, 1e4)).backend == (
                "reference"
            )
    assert torch.equal(pool, expected)
    assert builds == []
    said = [r.getMessage() for r in caplog.records if "not prepared" in r.getMessage()]
    assert len(said) == 1, said


def test_a_failing_launch_falls_back_once_and_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lib = FakeLib(code=INSUFFICIENT_DRIVER)
    fake_gpu(monkeypatch, lib)
    monkeypatch.setattr(cuda, "launch_test", lambda lib, device: None)
    assert cuda.prepare(torch.device("cuda", 0)).available  # as if the test had passed
    _as_if_on_the_gpu(monkeypatch)
    src, tokens, pool, slots = _gather_case()
    expected = pool.clone()
    reference.gather_kv(src, tokens, expected, slots)
    with caplog.at_level(logging.WARNING):
        assert ops.gather_kv(src, tokens, pool, slots) == ops.OpResult("reference")
        assert torch.equal(pool, expected)  # the op still happened, by torch
        state = ops.cuda_status()
        assert not state.available and "driver version is insufficient" in state.reason
        k = pool.clone()
        assert ops.apply_rope_kv(k, torch.arange(16), default_inv_freq(64, 1e4)).backend == (
            "reference"
        )
        assert ops.gather_kv(src, tokens, pool, slots).backend == "reference"
    assert lib.launches == ["copy"]  # tried once, never again
    errors = [r for r in caplog.records if r.exc_info is not None]
    assert errors == []  # a reason in one line, no traceback
    said = [r.getMessage() for r in caplog.records if "insufficient" in r.getMessage()]
    assert len(said) == 2, said  # cuda marks them unavailable; the ops say they fall back
