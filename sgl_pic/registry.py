"""Named registries of pluggable parts: token-selection policies and chunk stores.

``POLICIES`` and ``STORES`` are the one place their names live: config validation, the
launcher's ``--pic-policy`` choices and every "unknown name" error read them from here.

Built-in entries are declared lazily, as ``"module:attribute"`` paths: ``PicConfig`` is
built by torch-free modules (the SGLang frontend helper) and must be able to check a
policy name without importing the torch-heavy module that implements it. A lazy entry is
imported on its first ``get``; the decorator in that module (``register_policy`` /
``register_store``) then lands on the same name and path, which is accepted as the same
entry rather than a duplicate.

Plugging in another store (for example one shared across a distributed engine, such as
Mooncake or Redis): subclass ``sgl_pic.store.ChunkStore``, give it a ``name``, and either
decorate the class with ``@register_store`` (registered when its module is imported), or
name it without importing it::

    from sgl_pic.registry import STORES

    STORES.add_lazy("mooncake", "my_pkg.mooncake_store:MooncakeStore")

after which ``make_store("mooncake", config, model_digest)`` builds it. Policies plug in
the same way through ``POLICIES`` (``make_policy`` builds them from a ``PicConfig``);
``PicConfig.policy`` accepts any name registered before the config is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
E = TypeVar("E")


class UnknownNameError(ValueError):
    """A name no registry entry has. A ValueError, so callers that turn bad settings into
    HTTP 400s or CLI errors treat it like any other invalid value."""


class DuplicateNameError(ValueError):
    """A second, different entry registered under a name already taken."""


@dataclass(frozen=True)
class LazyEntry:
    """An entry named by import path, resolved on first use."""

    module: str
    attribute: str

    @classmethod
    def parse(cls, target: str) -> LazyEntry:
        module, sep, attribute = target.partition(":")
        if not (sep and module and attribute):
            raise ValueError(f"lazy entry {target!r} is not of the form 'module:attribute'")
        return cls(module, attribute)

    def points_to(self, entry: object) -> bool:
        """Whether ``entry`` is the object this path points to (checked without importing)."""
        return (
            getattr(entry, "__module__", None) == self.module
            and getattr(entry, "__qualname__", None) == self.attribute
        )


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order.

    Not locked: registration happens at import time (under the import lock), and resolving
    a lazy entry twice from two threads stores the same object twice.
    """

    def __init__(self, kind: str, kinds: str) -> None:
        """``kind`` / ``kinds``: singular and plural nouns for error messages ("policy",
        "policies")."""
        self.kind = kind
        self.kinds = kinds
        self._entries: dict[str, T | LazyEntry] = {}

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` and return it. Registering the same entry again
        (or the entry a lazy path names) is a no-op; a different one raises."""
        held = self._entries.get(name)
        if held is not None and not _same_entry(held, entry):
            raise DuplicateNameError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[E], E]:
        """Decorator form of ``add``: ``@REGISTRY.register("name")``."""

        def decorate(entry: E) -> E:
            self.add(name, entry)  # type: ignore[arg-type]  # E is the caller's subtype of T
            return entry

        return decorate

    def add_lazy(self, name: str, target: str) -> None:
        """Register ``name`` as the object at ``target`` ("module:attribute"), imported on
        the first ``get``; the name is known (``names``, ``in``) right away."""
        lazy = LazyEntry.parse(target)
        held = self._entries.get(name)
        if held is not None and not _same_entry(held, lazy):
            raise DuplicateNameError(f"{self.kind} {name!r} is already registered")
        if held is None:  # an entry already imported stays imported
            self._entries[name] = lazy

    def check(self, name: str) -> None:
        """Raise UnknownNameError, listing the known names, unless ``name`` is registered;
        imports nothing (so a lazy entry's module may still fail to import on ``get``)."""
        if name not in self._entries:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid {self.kinds}: {', '.join(self.names())}"
            )

    def get(self, name: str) -> T:
        """The entry registered as ``name``; raises UnknownNameError listing the known
        names."""
        self.check(name)
        held = self._entries[name]
        if not isinstance(held, LazyEntry):
            return held
        module = importlib.import_module(held.module)  # may register it via its decorator
        entry: T = getattr(module, held.attribute)
        return self.add(name, entry)

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order; imports nothing."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _same_entry(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` are one entry: the same object, equal paths, or an object and
    the path that names it."""
    if a is b:
        return True
    if isinstance(a, LazyEntry) and isinstance(b, LazyEntry):
        return a == b
    if isinstance(a, LazyEntry):
        return a.points_to(b)
    return isinstance(b, LazyEntry) and b.points_to(a)


# The entries' types are not named here: this module is the ground floor that
# ``sgl_pic.config``, ``sgl_pic.selection`` and ``sgl_pic.store`` build on, so naming their
# classes (even for the type checker) would make each of them depend on the others.
# ``make_policy`` (``sgl_pic.selection.registry``) and ``make_store`` (``sgl_pic.store``)
# give what they get from here its type.
POLICIES: Registry[type[Any]] = Registry("policy", "policies")  # SelectionPolicy subclasses
for _name, _target in (
    ("full_recompute", "sgl_pic.selection.baselines:FullRecompute"),
    ("full_reuse", "sgl_pic.selection.baselines:FullReuse"),
    ("epic", "sgl_pic.selection.baselines:Epic"),
    ("cacheblend", "sgl_pic.selection.cacheblend:CacheBlend"),
    ("daric", "sgl_pic.selection.daric:Daric"),
    ("cachetune", "sgl_pic.selection.cachetune:CacheTune"),
    ("query_aware", "sgl_pic.selection.query_aware:QueryAware"),
):
    POLICIES.add_lazy(_name, _target)

STORES: Registry[type[Any]] = Registry("store", "stores")  # ChunkStore subclasses
for _name, _target in (
    ("host", "sgl_pic.store.host:HostStore"),
    ("disk", "sgl_pic.store.disk.store:DiskStore"),
    ("tiered", "sgl_pic.store.tiered:TieredStore"),
):
    STORES.add_lazy(_name, _target)
del _name, _target
