"""The launcher's ``--pic-*`` flags and the README's flags table, made from the declared
settings (``sgl_pic.declare``): ``PicConfig``'s (``CONFIG_SETTINGS``), the server's
(``SERVER_SETTINGS``) and the launcher's own (``LAUNCH_SETTINGS`` below). A setting has a
flag here exactly when its declaration names one; nothing else lists flags.

``python -m sgl_pic.cli.flags`` prints the README table; ``--write README.md`` replaces it
there between its markers (``tests/cli/test_flags.py`` fails while they differ).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sgl_pic.binding.settings import SERVER_SETTINGS
from sgl_pic.config import CONFIG_SETTINGS
from sgl_pic.declare import Override, Setting

# Flags of the launcher itself: they steer the launch and reach no settings object.
LAUNCH_SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="check",
        type="bool",
        default=False,
        help="run the correctness gate (python -m sgl_pic.check) on the model first; reuse "
        "is refused (exact prefill for every request) if it fails",
        flag="--pic-check",
    ),
    Setting(
        name="check_out",
        type="str",
        default="",
        help="where --pic-check writes its JSON report ('': nowhere)",
        flag="--pic-check-out",
        metavar="PATH",
    ),
    Setting(
        name="disable",
        type="bool",
        default=False,
        help="serve plain SGLang through the same launcher (the baseline)",
        flag="--pic-disable",
    ),
)
# Every flag, in the order of the help and the README table.
FLAGS: tuple[Setting, ...] = tuple(
    s for s in (*CONFIG_SETTINGS, *SERVER_SETTINGS, *LAUNCH_SETTINGS) if s.flag
)
_TYPES: dict[str, Any] = {"int": int, "float": float, "str": None}
README_BEGIN = "<!-- flags:begin -->"
README_END = "<!-- flags:end -->"


def pic_arg_parser() -> argparse.ArgumentParser:
    """A parser of every ``--pic-*`` flag (no ``--help`` of its own: SGLang's parser sees
    the rest of the command line)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sgl_pic")
    for s in FLAGS:
        help_text = s.help.replace("%", "%%")  # argparse formats help with %
        if s.type == "bool":
            g.add_argument(s.flag, action="store_true", help=help_text)
            continue
        g.add_argument(
            s.flag,
            type=_TYPES[s.type],
            # None: the launcher fills in its own default (``launch_default``) at launch.
            default=None if s.launch_default else s.default,
            choices=s.valid_choices(),
            metavar=s.metavar,
            help=help_text,
        )
    return p


def config_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """``PicConfig`` fields from the parsed flags (those with a flag)."""
    return _values(ns, CONFIG_SETTINGS)


def server_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """``PicServerSettings`` fields from the parsed flags (those with a flag), with the
    launcher's defaults filled in."""
    return _values(ns, SERVER_SETTINGS)


def _values(ns: argparse.Namespace, table: Iterable[Setting]) -> dict[str, Any]:
    out = {}
    for s in table:
        if not s.flag:
            continue
        value = getattr(ns, s.dest)
        if value is None and s.launch_default is not None:
            value = s.launch_default()
        out[s.name] = value
    return out


def markdown_table() -> str:
    """The README's flags table: one row per flag."""
    rows = [
        "| flag | default | per request | what it sets |",
        "| --- | --- | --- | --- |",
    ]
    for s in FLAGS:
        flag = f"`{s.flag} {s.metavar}`" if s.metavar else f"`{s.flag}`"
        what = _markdown(s.help)
        choices = s.valid_choices()
        if choices:
            what += "; one of " + ", ".join(f"`{c}`" for c in choices)
        rows.append(f"| {flag} | {_shown_default(s)} | {_per_request(s)} | {what} |")
    return "\n".join(rows) + "\n"


def _shown_default(s: Setting) -> str:
    if s.shown_default is not None:
        return _code(s.shown_default)
    if s.type == "bool":
        return "on" if s.default else "off"
    if s.type == "float":
        return format(s.default, "g")
    if s.type == "str":
        return _code(s.default) if s.default else "`''`"
    return str(s.default)


def _per_request(s: Setting) -> str:
    if s.override is Override.CONFIG:
        return f'`"config": {{"{s.name}": …}}`'
    if s.override is Override.CHAT:
        return f'`"pic": {{"{s.name}": …}}` (chat)'
    return "no"


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _markdown(text: str) -> str:
    """A help text as a table cell: reST literals as Markdown code, pipes escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text.replace("|", "\\|")


def with_table(readme: str) -> str:
    """``readme`` with the text between its flags markers replaced by ``markdown_table``."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {README_BEGIN} ... {README_END} block in the README")
    head = readme[: begin + len(README_BEGIN)]
    return f"{head}\n{markdown_table()}{readme[end:]}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print (or write) the README's flags table.")
    p.add_argument("--write", type=Path, metavar="README", help="replace the table there")
    args = p.parse_args(argv)
    if args.write is None:
        sys.stdout.write(markdown_table())
        return
    args.write.write_text(with_table(args.write.read_text()))


if __name__ == "__main__":
    main()
