"""A GPU and a kernel library faked on the CPU, for the loading and fallback paths of
``sgl_pic.ops.cuda`` and ``sgl_pic.ops.dispatch``.

torch reports one sm_90 device; device guards, streams and syncs become no-ops, so the
real launchers and the real launch test run on CPU tensors against a fake library whose
functions take the raw pointers and never dereference them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_pic.ops import cuda

LIBRARY = Path("/nonexistent/libsgl_pic_kernels-fake.so")
INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: a toolkit newer than the driver


class _Fn:
    """A ctypes function stand-in: callable, with settable argtypes/restype."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeLib:
    """The kernel library's four entry points. Launches return ``code`` and record their
    name; with code 0 they claim success without writing anything (a wrong result)."""

    def __init__(self, code: int = 0, abi: int = cuda.ABI_VERSION) -> None:
        self.code = code
        self.launches: list[str] = []
        self.pic_abi_version = _Fn(lambda: abi)
        self.pic_error_string = _Fn(self._error)
        self.pic_copy_rows = _Fn(lambda *args: self._launch("copy", args, 14))
        self.pic_rope_rows = _Fn(lambda *args: self._launch("rope", args, 17))

    @staticmethod
    def _error(code: int) -> bytes:
        if code == INSUFFICIENT_DRIVER:
            return b"CUDA driver version is insufficient for CUDA runtime version"
        return b"unknown error"

    def _launch(self, name: str, args: tuple[Any, ...], arity: int) -> int:
        assert len(args) == arity, (name, len(args))  # the launcher passed every argument
        self.launches.append(name)
        return self.code


def fake_gpu(monkeypatch: pytest.MonkeyPatch, lib: FakeLib | None = None) -> list[list[str]]:
    """Fresh kernel state and one fake GPU; ``lib`` is what loading the library opens.
    Returns the list of ``build_library`` calls (their archs), which the fake records."""
    monkeypatch.setattr(cuda, "_KERNELS", cuda._Kernels())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0)
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    builds: list[list[str]] = []

    def build(out_dir: Path, archs: list[str], *args: Any, **kwargs: Any) -> Path:
        builds.append(list(archs))
        return LIBRARY

    monkeypatch.setattr(cuda, "build_library", build)
    if lib is not None:
        monkeypatch.setattr(cuda.ctypes, "CDLL", lambda path: lib)
    return builds


def launch_test_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """The real launch test, its tensors on the CPU (the fake GPU has no memory).
    Returns the devices it was asked to test."""
    real = cuda.launch_test
    asked: list[torch.device] = []

    def run(lib: Any, device: torch.device) -> None:
        asked.append(device)
        real(lib, torch.device("cpu"))

    monkeypatch.setattr(cuda, "launch_test", run)
    return asked
