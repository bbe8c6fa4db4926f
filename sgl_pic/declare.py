"""Settings declared once: each field of a settings dataclass carries its whole declaration.

A field written ``qa_ratio: float = setting(0.15, "...", flag="--pic-qa-ratio",
check=in_range(0, 1, low_open=True), override=Override.CONFIG)`` is the only place that
setting is named. ``declared(cls)`` reads the table back (one frozen ``Setting`` per field,
in field order), and everything else is produced from it: validation
(``check_declared``, called by the dataclass's ``__post_init__``), the launcher's argparse
flags and the flag -> field mapping, and the README's flags table
(``sgl_pic.cli.flags``). Which settings a request may override is the ``override`` of
each entry (``overridable``).

Pure data and checks: no sgl_pic imports, safe from every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T")

# A check raises ValueError naming the setting (its first argument) and the bad value.
Check = Callable[[str, Any], None]

_KEY = "sgl_pic.setting"


class Override(Enum):
    """Whether and how one request may change a setting for itself."""

    NONE = "no"  # server-wide only
    CONFIG = "config"  # a request's ``"pic": {"config": {NAME: value}}`` (every endpoint)
    CHAT = "chat"  # /v1/chat/completions' ``"pic": {NAME: ...}`` (its own syntax)


@dataclass(frozen=True)
class Setting:
    """One setting. name/type/default come from the dataclass field when declared with
    ``setting`` (type is the annotation's text: "int", "float", "str", "bool").

    flag:            the launcher's ``--pic-*`` flag ("" where the launcher sets the value
                     itself, e.g. the page size SGLang resolved).
    metavar:         the flag's value placeholder in help and README.
    choices:         the valid values, or a function giving them when asked (registries
                     grow as plugins load); argparse refuses any other.
    check:           raises ValueError for a bad value; where none is given, a value not
                     in ``choices`` is refused with a generic message.
    override:        whether a request may override it (``Override``).
    launch_default:  the launcher's default where it is not the field's (computed at
                     launch: it depends on the machine); the flag's own default is then None.
    shown_default:   the default as the README shows it, where the value would mislead.
    """

    name: str
    type: str
    default: Any
    help: str
    flag: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] | Callable[[], Sequence[str]] | None = None
    check: Check | None = None
    override: Override = Override.NONE
    launch_default: Callable[[], Any] | None = None
    shown_default: str | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute the flag's value lands on."""
        return self.flag[2:].replace("-", "_")

    def valid_choices(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


def setting(
    default: T,
    help: str,
    *,
    flag: str = "",
    metavar: str | None = None,
    choices: tuple[str, ...] | Callable[[], Sequence[str]] | None = None,
    check: Check | None = None,
    override: Override = Override.NONE,
    launch_default: Callable[[], Any] | None = None,
    shown_default: str | None = None,
    repr: bool = True,
) -> T:
    """A dataclass field with its declaration; typed as its default so the annotation
    stays the field's type."""
    entry = Setting(
        name="",  # name and type are the field's, filled in by ``declared``
        type="",
        default=default,
        help=help,
        flag=flag,
        metavar=metavar,
        choices=choices,
        check=check,
        override=override,
        launch_default=launch_default,
        shown_default=shown_default,
    )
    field: T = dataclasses.field(default=default, repr=repr, metadata={_KEY: entry})
    return field


def declared(cls: type) -> tuple[Setting, ...]:
    """The settings of dataclass ``cls`` declared with ``setting``, in field order (fields
    declared otherwise, such as a nested settings object, are not in it)."""
    out = []
    for f in dataclasses.fields(cls):
        entry = f.metadata.get(_KEY)
        if entry is not None:
            # The annotation's text (modules with ``from __future__ import annotations``)
            # or the class's name.
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            out.append(dataclasses.replace(entry, name=f.name, type=kind))
    return tuple(out)


def check_declared(obj: Any, table: Sequence[Setting]) -> None:
    """Runs each setting's check (or its choices) of ``table`` (``declared(type(obj))``)
    on ``obj``'s values, in order; raises the first ValueError."""
    for s in table:
        value = getattr(obj, s.name)
        choices = s.valid_choices()
        if s.check is not None:
            s.check(s.name, value)
        elif choices is not None:
            one_of(choices)(s.name, value)


def overridable(cls: type, how: Override = Override.CONFIG) -> frozenset[str]:
    """Names of ``cls``'s settings a request may override the ``how`` way."""
    return frozenset(s.name for s in declared(cls) if s.override is how)


# Checks. Messages name the setting and the value; launch errors and HTTP 400s show them.


def in_range(low: float, high: float, *, low_open: bool = False) -> Check:
    """``low <= value <= high`` (``low < value`` when ``low_open``)."""

    def check(name: str, value: Any) -> None:
        if not (low < value if low_open else low <= value) or value > high:
            bracket = "(" if low_open else "["
            raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")

    return check


def int_in(low: int, high: int | None = None) -> Check:
    """An int (not a bool) with ``low <= value`` (and ``<= high`` when given)."""

    def check(name: str, value: Any) -> None:
        ok = not isinstance(value, bool) and isinstance(value, int) and value >= low
        if high is None:
            if not ok:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        elif not ok or value > high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")

    return check


def one_of(values: tuple[str, ...], what: str = "", plural: str = "") -> Check:
    """``value in values``; the message calls it ``what`` (default: the setting's name)."""

    def check(name: str, value: Any) -> None:
        if value not in values:
            raise ValueError(
                f"unknown {what or name} {value!r}; valid{' ' + plural if plural else ''}: "
                f"{', '.join(values)}"
            )

    return check


def by_value(fn: Callable[[Any], object]) -> Check:
    """A check from a function of the value alone that raises ValueError itself (a
    registry's ``check``, a parser)."""

    def check(_name: str, value: Any) -> None:
        fn(value)

    return check


def all_of(*checks: Check) -> Check:
    """Each check in turn."""

    def check(name: str, value: Any) -> None:
        for c in checks:
            c(name, value)

    return check
