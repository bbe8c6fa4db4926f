"""Loading the kernels at start-up, on the CPU with the GPU and the library faked
(``tests/ops/fake_cuda.py``): ``prepare`` builds once, launch-tests each device, and any
failure (build, ABI, launch error, wrong result) marks the kernels unavailable once with
its reason; ``status`` never builds; a launch that fails in service does the same."""

from __future__ import annotations

import logging

import pytest
import torch

from sgl_pic.ops import cuda, cuda_selftest
from sgl_pic.ops.reference import run_copy, run_rope
from sgl_pic.ops.validate import plan_gather
from tests.ops.fake_cuda import (
    INSUFFICIENT_DRIVER,
    LIBRARY,
    FakeLib,
    fake_gpu,
    launch_test_on_cpu,
)

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _unavailable_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "CUDA kernels unavailable" in r.message]


def test_a_cpu_device_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = fake_gpu(monkeypatch, FakeLib())
    state = cuda.prepare(torch.device("cpu"))
    assert not state.available and "not a CUDA device" in state.reason
    assert builds == []
    assert "not prepared" in cuda.status().reason  # a later prepare(cuda) may still run


def test_status_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = fake_gpu(monkeypatch, FakeLib())
    state = cuda.status()
    assert not state.available and "not prepared" in state.reason
    with pytest.raises(cuda.KernelError, match="not prepared"):
        cuda.require()
    assert builds == []


def test_prepare_builds_once_and_tests_each_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = fake_gpu(monkeypatch, FakeLib())
    tested: list[torch.device] = []
    monkeypatch.setattr(cuda, "launch_test", lambda lib, device: tested.append(device))
    first = cuda.prepare(GPU0)
    assert first.available and first.library == LIBRARY, first
    assert cuda.prepare(GPU0) == first and cuda.status() == first
    assert cuda.prepare(GPU1).available
    assert builds == [["90"]] and tested == [GPU0, GPU1]


def test_a_build_failure_is_final(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_gpu(monkeypatch, FakeLib())
    calls: list[list[str]] = []

    def broken(out_dir, archs, *args, **kwargs):
        calls.append(archs)
        raise RuntimeError("nvcc failed (1): unsupported gpu architecture 'compute_90'")

    monkeypatch.setattr(cuda, "build_library", broken)
    with caplog.at_level(logging.WARNING):
        state = cuda.prepare(GPU0)
        assert not state.available and "nvcc failed" in state.reason
        assert cuda.prepare(GPU0) == state and cuda.prepare(GPU1) == state
    assert len(calls) == 1
    assert len(_unavailable_logs(caplog)) == 1


def test_an_abi_mismatch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real open_library binds the fake's entry points and reads its ABI version.
    fake_gpu(monkeypatch, FakeLib(abi=cuda.ABI_VERSION + 1))
    state = cuda.prepare(GPU0)
    assert not state.available and f"kernel ABI {cuda.ABI_VERSION + 1}" in state.reason


def test_a_launch_error_in_the_launch_test_is_final(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lib = FakeLib(code=INSUFFICIENT_DRIVER)
    builds = fake_gpu(monkeypatch, lib)
    asked = launch_test_on_cpu(monkeypatch)
    with caplog.at_level(logging.WARNING):
        state = cuda.prepare(GPU0)
        assert not state.available
        assert "launch test on cuda:0" in state.reason
        assert "driver version is insufficient" in state.reason
        assert cuda.prepare(GPU0) == state == cuda.status()
    assert lib.launches == ["copy"] and asked == [GPU0] and builds == [["90"]]
    assert len(_unavailable_logs(caplog)) == 1


def test_a_wrong_result_in_the_launch_test_is_final(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeLib(code=0)  # claims success, writes nothing
    fake_gpu(monkeypatch, lib)
    launch_test_on_cpu(monkeypatch)
    state = cuda.prepare(GPU0)
    assert not state.available and "disagrees with the torch reference" in state.reason
    assert lib.launches == ["copy"]


def test_the_launch_test_covers_every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # With copies that "succeed", the test reaches RoPE only once copies are right: run
    # it against a library whose copies are done by torch, to see the rope launch too.
    lib = FakeLib(code=0)
    fake_gpu(monkeypatch, lib)
    monkeypatch.setattr(cuda_selftest, "launch_copy", lambda lib_, plan, t: run_copy(plan))
    with pytest.raises(cuda.KernelError, match="pic_rope_rows \\(neox\\)"):
        cuda.launch_test(lib, torch.device("cpu"))
    assert lib.launches == ["rope"]


def test_a_launch_error_in_service_marks_the_kernels_unavailable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lib = FakeLib(code=INSUFFICIENT_DRIVER)
    fake_gpu(monkeypatch, lib)
    monkeypatch.setattr(cuda, "launch_test", lambda lib, device: None, raising=False)
    assert cuda.load().available  # as if the launch test had passed
    src, pool = torch.randn(2, 8, 2, 64), torch.randn(2, 16, 2, 64)
    plan = plan_gather(src, torch.tensor([1, 2]), pool, torch.tensor([3, 4]))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(RuntimeError, match="driver version is insufficient"):
            cuda.run_copy(plan)
        state = cuda.status()
        assert not state.available and "driver version is insufficient" in state.reason
        with pytest.raises(RuntimeError, match="unavailable"):
            cuda.run_copy(plan)  # not launched again
    assert lib.launches == ["copy"]
    assert len(_unavailable_logs(caplog)) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_a_cuda_device_without_a_gpu_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "_KERNELS", cuda._Kernels())
    builds: list[object] = []
    monkeypatch.setattr(cuda, "build_library", lambda *a, **k: builds.append(a))
    state = cuda.prepare(torch.device("cuda"))
    assert not state.available and "no CUDA device" in state.reason
    assert cuda.status() == state and builds == []


def test_no_status_says_available_before_the_launch_test_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpu(monkeypatch, FakeLib())
    seen: list[bool] = []

    def test_reading_status(lib, device) -> None:
        seen.append(cuda.status().available)  # what an op on another thread would read
        with pytest.raises(cuda.KernelError):
            cuda.require()

    monkeypatch.setattr(cuda, "launch_test", test_reading_status)
    assert cuda.prepare(GPU0).available and seen == [False]
    assert cuda.require() is not None


def test_the_launch_test_passes_a_right_library_and_catches_each_wrong_rope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Launchers that do what the kernels should (the torch reference) pass; one that
    # rotates interleaved keys as neox is caught there.
    lib, cpu = FakeLib(), torch.device("cpu")
    fake_gpu(monkeypatch, lib)  # syncs become no-ops
    monkeypatch.setattr(cuda_selftest, "launch_copy", lambda lib_, plan, t: run_copy(plan))
    monkeypatch.setattr(cuda_selftest, "launch_rope", lambda lib_, plan, t: run_rope(plan))
    cuda.launch_test(lib, cpu)

    def neox_only(lib_, plan, tables) -> None:
        run_rope(plan._replace(layout="neox"))

    monkeypatch.setattr(cuda_selftest, "launch_rope", neox_only)
    with pytest.raises(cuda.KernelError, match="pic_rope_rows \\(interleaved\\)"):
        cuda.launch_test(lib, cpu)
