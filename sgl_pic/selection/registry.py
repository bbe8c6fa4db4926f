"""Selection policies by name: the policy side of ``sgl_pic.registry.POLICIES``."""

from __future__ import annotations

from sgl_pic.config import PicConfig
from sgl_pic.registry import POLICIES
from sgl_pic.selection.base import SelectionPolicy


def register_policy(cls: type[SelectionPolicy]) -> type[SelectionPolicy]:
    """Class decorator: make ``cls`` available as ``cls.name``."""
    return POLICIES.add(cls.name, cls)


def policy_names() -> tuple[str, ...]:
    """Every registered policy name, in registration order."""
    return POLICIES.names()


def make_policy(config: PicConfig, name: str | None = None) -> SelectionPolicy:
    """The policy ``name`` (default ``config.policy``) built with ``config``; raises
    ``UnknownNameError`` (a ValueError) naming the valid policies."""
    return POLICIES.get(config.policy if name is None else name)(config)
