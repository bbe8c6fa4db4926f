"""Stand-in for torchvision on the CPU serving path (PyPI's wheel fails with torch 2.13).

SGLang's config modules and transformers' image utilities import torchvision names at module
level; a text model never calls them. Every ``torchvision.*`` submodule is synthesised on
import; every name in it is a class whose construction or call raises NotImplementedError,
so nothing that would need torchvision is silently skipped. ``InterpolationMode`` is a plain
enum that modules read at import time, so it is real.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+sgl_pic_cpu_stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(qualname: str) -> type:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualname} is unavailable: sgl_pic serves text models on the CPU with a "
            "torchvision stand-in (sgl_pic/binding/cpu_stubs/torchvision)"
        )

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": fail, "__call__": fail})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        value = _unavailable(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())

sys.modules[__name__].__class__ = _StubModule
