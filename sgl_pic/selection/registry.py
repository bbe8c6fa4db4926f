"""Policies registered by name."""

from __future__ import annotations

from sgl_pic.config import POLICY_NAMES, PicConfig
from sgl_pic.selection.base import SelectionPolicy

_REGISTRY: dict[str, type[SelectionPolicy]] = {}


def register_policy(cls: type[SelectionPolicy]) -> type[SelectionPolicy]:
    """Class decorator: make ``cls`` available as ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_REGISTRY))


def make_policy(config: PicConfig, name: str | None = None) -> SelectionPolicy:
    """The policy ``name`` (default ``config.policy``) built with ``config``."""
    _load_builtin()
    key = config.policy if name is None else name
    if key not in _REGISTRY:
        raise ValueError(f"unknown policy {key!r}; valid policies: {', '.join(policy_names())}")
    return _REGISTRY[key](config)


def _load_builtin() -> None:
    # Imported for their registration side effect; deferred to avoid an import cycle.
    from sgl_pic.selection import baselines, cacheblend, cachetune, daric  # noqa: F401

    missing = set(POLICY_NAMES) - set(_REGISTRY)
    if missing:
        raise RuntimeError(f"built-in policies failed to register: {sorted(missing)}")
