"""Settings declared on their fields (``sgl_pic.declare``): the table read back, checks run
in order, override rules."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from sgl_pic.declare import (
    Override,
    Setting,
    check_declared,
    declared,
    in_range,
    int_in,
    one_of,
    overridable,
    setting,
)


@dataclass(frozen=True)
class Toy:
    nested: str  # not declared: not in the table
    ratio: float = setting(0.5, "a ratio", flag="--toy-ratio", check=in_range(0, 1, low_open=True))
    mode: str = setting(
        "a", "a mode", flag="--toy-mode", choices=("a", "b"), override=Override.CONFIG
    )
    count: int = setting(0, "a count", check=int_in(0, 8), override=Override.CHAT)
    hidden: str = setting("", "kept out of repr", repr=False)

    def __post_init__(self) -> None:
        check_declared(self, declared(Toy))


def test_the_table_is_read_back_from_the_fields_in_order() -> None:
    table = declared(Toy)
    assert [s.name for s in table] == ["ratio", "mode", "count", "hidden"]
    assert table[0] == Setting(
        "ratio", "float", 0.5, "a ratio", "--toy-ratio", check=table[0].check
    )
    assert table[1].dest == "toy_mode" and table[1].valid_choices() == ("a", "b")
    assert [f.default for f in fields(Toy)[1:]] == [0.5, "a", 0, ""]
    assert "hidden" not in repr(Toy("x", hidden="h"))


def test_checks_run_on_construction_with_messages_naming_the_setting() -> None:
    Toy("x", 1.0, "b", 8)
    with pytest.raises(ValueError, match=r"^ratio must be in \(0, 1\], got 0$"):
        Toy("x", ratio=0)
    with pytest.raises(ValueError, match=r"^unknown mode 'c'; valid: a, b$"):
        Toy("x", mode="c")
    with pytest.raises(ValueError, match=r"^count must be an int in \[0, 8\], got True$"):
        Toy("x", count=True)
    with pytest.raises(ValueError, match=r"^n must be an int >= 2, got 1$"):
        int_in(2)("n", 1)
    with pytest.raises(ValueError, match=r"^unknown MTAF 'x'; valid MTAFs: a$"):
        one_of(("a",), "MTAF", "MTAFs")("m", "x")


def test_the_first_bad_setting_in_field_order_is_reported() -> None:
    with pytest.raises(ValueError, match="^ratio"):
        Toy("x", ratio=2.0, mode="c")


def test_override_rules_are_read_per_kind() -> None:
    assert overridable(Toy) == {"mode"}
    assert overridable(Toy, Override.CHAT) == {"count"}
    assert overridable(Toy, Override.NONE) == {"ratio", "hidden"}


def test_a_module_without_string_annotations_declares_the_same_types() -> None:
    import dataclasses

    Plain = dataclasses.make_dataclass(
        "Plain", [("n", int, setting(1, "n")), ("x", float, setting(0.5, "x"))]
    )
    assert [(s.name, s.type) for s in declared(Plain)] == [("n", "int"), ("x", "float")]
