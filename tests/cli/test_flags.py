"""The ``--pic-*`` flags made from the declared settings (``sgl_pic.cli.flags``): the same
flags, types, choices and defaults as the hand-written parser of f33133e, each reaching its
field, and the README's table equal to the generated one."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sgl_pic.binding.settings import SERVER_SETTINGS, PicServerSettings
from sgl_pic.cli.flags import (
    FLAGS,
    LAUNCH_SETTINGS,
    README_BEGIN,
    README_END,
    config_kwargs,
    markdown_table,
    pic_arg_parser,
    server_kwargs,
    with_table,
)
from sgl_pic.cli.launch_server import build
from sgl_pic.config import CONFIG_SETTINGS, PicConfig
from sgl_pic.declare import Setting

ROOT = Path(__file__).resolve().parents[2]
BEFORE = json.loads((Path(__file__).parent / "data" / "pic_flags_f33133e.json").read_text())
MODEL = ["--model-path", "/some/model"]


def describe(action: argparse.Action) -> dict[str, Any]:
    return {
        "option_strings": action.option_strings,
        "dest": action.dest,
        "type": getattr(action.type, "__name__", None),
        "choices": list(action.choices) if action.choices else None,
        "default": action.default,
        "metavar": action.metavar,
        "action": type(action).__name__,
    }


# Flags declared after f33133e, as the parser describes them.
ADDED = {
    ("--pic-chunk-context",): {
        "option_strings": ["--pic-chunk-context"],
        "dest": "pic_chunk_context",
        "type": None,
        "choices": ["none", "first_chunk"],
        "default": "none",
        "metavar": None,
        "action": "_StoreAction",
    },
    ("--pic-phase2-read-budget",): {
        "option_strings": ["--pic-phase2-read-budget"],
        "dest": "pic_phase2_read_budget",
        "type": "float",
        "choices": None,
        "default": 1.4,
        "metavar": "X",
        "action": "_StoreAction",
    },
    ("--pic-phase2-read-min-tokens",): {
        "option_strings": ["--pic-phase2-read-min-tokens"],
        "dest": "pic_phase2_read_min_tokens",
        "type": "int",
        "choices": None,
        "default": 8192,
        "metavar": "N",
        "action": "_StoreAction",
    },
}


def test_the_parser_takes_the_flags_it_took_before() -> None:
    # Captured from f33133e's hand-written pic_arg_parser (help texts aside), and those
    # added since.
    got = {tuple(a.option_strings): describe(a) for a in pic_arg_parser()._actions}
    want = {tuple(a["option_strings"]): a for a in BEFORE["actions"]}
    assert got == {**want, **ADDED}


def test_every_flag_has_one_declaration() -> None:
    flags = [s.flag for s in FLAGS]
    assert len(flags) == len(set(flags)) and all(f.startswith("--pic-") for f in flags)
    assert all(s.help for s in FLAGS)


def non_default(s: Setting) -> tuple[str, Any]:
    """A valid value other than the default, as typed on a command line and as parsed."""
    choices = s.valid_choices()
    if choices:
        value: Any = next(c for c in choices if c != s.default)
    elif s.name == "shared_store":
        value = "mooncake://10.0.0.5:50551"
    elif s.name == "auto_chunk":
        value = "tool,document"
    elif s.type == "str":
        value = s.name + "-x"
    elif s.type == "float":
        value = 0.25 if s.default != 0.25 else 0.5
    else:
        value = s.default + 1
    return str(value), value


def test_each_flag_reaches_its_field() -> None:
    argv = [*MODEL, "--pic-calibrate"]
    want: dict[str, Any] = {"calibrate": True}
    for s in (*CONFIG_SETTINGS, *SERVER_SETTINGS):
        if s.flag and s.type != "bool":
            text, want[s.name] = non_default(s)
            argv += [s.flag, text]
    _, ns, config = build(argv)
    settings = PicServerSettings(config, **server_kwargs(ns))
    for s in CONFIG_SETTINGS:
        if s.flag:
            assert getattr(config, s.name) == want[s.name], s.flag
    for s in SERVER_SETTINGS:
        if s.flag:
            assert getattr(settings, s.name) == want[s.name], s.flag


def test_defaults_reach_the_fields_and_the_launcher_fills_in_its_own() -> None:
    from sgl_pic.paths import cache_root

    ns = pic_arg_parser().parse_args([])
    assert PicConfig(**config_kwargs(ns)) == PicConfig()
    got = server_kwargs(ns)
    assert got.pop("disk_cache_dir") == str(cache_root() / "chunks")  # on by default
    assert PicServerSettings(PicConfig(), **got, disk_cache_dir="") == PicServerSettings(
        PicConfig()
    )
    assert {s.dest for s in LAUNCH_SETTINGS} == {"pic_check", "pic_check_out", "pic_disable"}


def test_help_texts_survive_argparse_formatting() -> None:
    parser = argparse.ArgumentParser(parents=[pic_arg_parser()])
    text = parser.format_help()
    assert all(s.flag in text for s in FLAGS)


def test_the_readme_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert README_BEGIN in readme and README_END in readme
    assert with_table(readme) == readme, (
        "README's flags table differs from the declared settings; regenerate it with "
        "`python -m sgl_pic.cli.flags --write README.md`"
    )
    table = markdown_table()
    assert all(f"`{s.flag}" in table for s in FLAGS)


def test_the_table_is_printed_and_written_by_the_module(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nstale\n{README_END}\n\nrest\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = [sys.executable, "-m", "sgl_pic.cli.flags"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout == markdown_table()
    subprocess.run([*run, "--write", str(readme)], env=env, check=True, timeout=300)
    assert readme.read_text() == f"# x\n\n{README_BEGIN}\n{markdown_table()}{README_END}\n\nrest\n"
    with pytest.raises(ValueError, match="flags:begin"):
        with_table("no markers")
