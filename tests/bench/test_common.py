"""The plumbing the benchmarks share (bench/_common.py, bench/_server.py): the commit a
result records, how result files are written, the common options, and how a server is
started from a given checkout."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def common() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("_common")
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def server(common: ModuleType) -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("_server")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_git_state_is_the_checkouts(common: ModuleType) -> None:
    state = common.git_state()
    assert state.commit == _git("rev-parse", "HEAD")
    assert state.dirty == bool(_git("status", "--porcelain"))
    tracked_only = common.git_state(untracked=False)
    assert tracked_only.dirty == bool(_git("status", "--porcelain", "--untracked-files=no"))
    # Results record it as two fields, or as a {"commit", "dirty"} object (fidelity.json).
    assert state._asdict() == {"commit": state.commit, "dirty": state.dirty}


def test_git_outside_a_checkout_is_none(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(common, "ROOT", tmp_path)  # no repository here or above /tmp
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert common.git_state() == (None, None)
    assert common.git_state(root=tmp_path) == (None, None)


def test_git_state_of_another_checkout(common: ModuleType, tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"]}
    (tmp_path / "a").write_text("a")
    for cmd in (["add", "a"], ["commit", "-qm", "a"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True, env=env)
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert common.git_state(root=tmp_path) == (head, False)
    assert common.git_state().commit != head  # ROOT's own stays the default
    (tmp_path / "b").write_text("b")
    assert common.git_state(root=tmp_path) == (head, True)


def test_write_json_keeps_each_layout(common: ModuleType, tmp_path: Path) -> None:
    data = {"a": [1, 2], "b": {"c": 0.5}}
    one = common.write_json(tmp_path / "deep" / "one.json", data)
    assert one.read_text() == json.dumps(data, indent=1)
    two = common.write_json(tmp_path / "two.json", data, indent=2, newline=True)
    assert two.read_text() == json.dumps(data, indent=2) + "\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deep", "one.json", "two.json"]


def test_write_json_leaves_the_old_file_when_data_cannot_be_written(
    common: ModuleType, tmp_path: Path
) -> None:
    out = common.write_json(tmp_path / "r.json", {"run": 1})
    with pytest.raises(TypeError):
        common.write_json(out, {"run": object()})
    assert json.loads(out.read_text()) == {"run": 1}


def test_common_options(common: ModuleType) -> None:
    ap = argparse.ArgumentParser()
    common.add_data_option(ap)
    common.add_out_option(ap, "x.json")
    common.add_server_args_option(ap)
    args = ap.parse_args([])
    # Strings by default: scripts record vars(args) in their JSON.
    assert args.data == str(common.DEFAULT_DATA)
    assert args.out == str(ROOT / "bench" / "results" / "x.json")
    assert args.server_args == ""
    json.dumps(vars(args))

    ap = argparse.ArgumentParser()
    common.add_data_option(ap, as_path=True)
    common.add_model_option(ap)
    common.add_out_option(ap, "y.json", as_path=True)
    args = ap.parse_args(["--model", "m", "--out", "o.json"])
    assert (args.data, args.model, args.out) == (common.DEFAULT_DATA, Path("m"), Path("o.json"))


def test_launch_runs_the_given_checkout(
    server: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``launch`` starts ``python -m sgl_pic.launch_server`` in ``root`` with ``root`` first on
    PYTHONPATH (bench/compare_paths.py starts an older commit's tree this way)."""
    import sgl_pic.cli.server_process as server_process

    seen: dict[str, Any] = {}
    log = tmp_path / "server.log"
    log.write_text("")

    @contextlib.contextmanager
    def fake(args: list[str], timeout: float, **kw: Any) -> Iterator[SimpleNamespace]:
        seen.update(kw, args=args, timeout=timeout)
        yield SimpleNamespace(url="http://127.0.0.1:1/", log_path=str(log), pid=4242)

    monkeypatch.setattr(server_process, "server_process", fake)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    tree = tmp_path / "old_tree"
    with server.launch(
        ["--x"], 5.0, env_extra={"V": "1"}, root=tree, log_prefix="p_", quiet=True
    ) as client:
        assert (client.url, client.pgid) == ("http://127.0.0.1:1", 4242)
    assert (seen["args"], seen["timeout"], seen["cwd"]) == (["--x"], 5.0, str(tree))
    assert seen["log_prefix"] == "p_"
    assert seen["env"]["PYTHONPATH"] == os.pathsep.join([str(tree), "/elsewhere"])
    assert seen["env"]["V"] == "1"
