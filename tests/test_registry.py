"""The generic name registry, and the policy and store registries built on it."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict

import pytest

from sgl_pic.registry import (
    POLICIES,
    STORES,
    DuplicateNameError,
    LazyEntry,
    Registry,
    UnknownNameError,
)


def fresh() -> Registry[type]:
    return Registry("widget", "widgets")


def test_add_get_names_contains_in_registration_order() -> None:
    reg = fresh()
    assert reg.add("b", int) is int
    assert reg.register("a")(str) is str  # decorator form returns its argument
    assert reg.names() == ("b", "a")
    assert reg.get("a") is str and reg.get("b") is int
    assert "a" in reg and "c" not in reg


def test_a_second_entry_under_a_taken_name_is_refused() -> None:
    reg = fresh()
    reg.add("x", int)
    reg.add("x", int)  # the same entry again: a no-op (modules may be imported twice)
    with pytest.raises(DuplicateNameError, match="widget 'x' is already registered"):
        reg.add("x", float)
    with pytest.raises(DuplicateNameError):
        reg.add_lazy("x", "collections:OrderedDict")
    assert reg.get("x") is int
    assert issubclass(DuplicateNameError, ValueError)


def test_unknown_name_lists_every_known_one() -> None:
    reg = fresh()
    reg.add("first", int)
    reg.add_lazy("second", "collections:OrderedDict")
    for look_up in (reg.get, reg.check):
        with pytest.raises(
            UnknownNameError, match="unknown widget 'nope'; valid widgets: first, second"
        ):
            look_up("nope")
    # Callers (config validation, HTTP 400 paths) catch ValueError.
    assert issubclass(UnknownNameError, ValueError)


def test_lazy_entry_is_known_at_once_and_imported_on_get() -> None:
    reg = fresh()
    reg.add_lazy("od", "collections:OrderedDict")
    assert "od" in reg and reg.names() == ("od",)
    reg.check("od")
    assert reg.get("od") is OrderedDict
    reg.add_lazy("od", "collections:OrderedDict")  # declaring it again keeps the import
    assert reg.get("od") is OrderedDict


def test_registering_the_object_a_lazy_path_names_is_not_a_duplicate() -> None:
    # What a built-in's own decorator does when the lazy get imports its module.
    reg = fresh()
    reg.add_lazy("od", "collections:OrderedDict")
    reg.add("od", OrderedDict)
    assert reg.get("od") is OrderedDict
    with pytest.raises(DuplicateNameError):
        reg.add("od", dict)


@pytest.mark.parametrize("target", ["collections", "collections:", ":OrderedDict", ""])
def test_lazy_targets_must_name_module_and_attribute(target: str) -> None:
    with pytest.raises(ValueError, match="module:attribute"):
        LazyEntry.parse(target)


def test_builtin_names() -> None:
    assert POLICIES.names() == (
        "full_recompute",
        "full_reuse",
        "epic",
        "cacheblend",
        "daric",
        "cachetune",
        "query_aware",
    )
    assert set(STORES.names()) >= {"host", "disk", "tiered"}


@pytest.mark.parametrize("name", ["host", "disk", "tiered"])
def test_every_builtin_store_resolves_to_the_class_of_that_name(name: str) -> None:
    from sgl_pic.store import ChunkStore

    cls = STORES.get(name)
    assert issubclass(cls, ChunkStore) and cls.name == name


def test_config_validates_policy_names_without_importing_torch() -> None:
    # PicConfig is built by torch-free modules (the frontend helper), so the policy names
    # must be known before any policy module is imported.
    code = (
        "import sys\n"
        "from sgl_pic.config import PicConfig\n"
        "PicConfig(policy='cachetune')\n"
        "try:\n"
        "    PicConfig(policy='nope')\n"
        "except ValueError as e:\n"
        "    assert 'valid policies: full_recompute' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('unknown policy accepted')\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_registry_names_no_module_of_the_package() -> None:
    """The ground floor: config, selection and store build on this module, so it imports
    none of them, not even for type hints (that made config -> registry -> selection.base
    -> config one loop); its entries are named by path only."""
    import ast
    from pathlib import Path

    import sgl_pic.registry as registry

    tree = ast.parse(Path(registry.__file__).read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name.split(".")[0] == "sgl_pic"], imported
