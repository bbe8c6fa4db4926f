"""What every benchmark shares, whichever it measures: where the checkout, the default data
and the results live, the embedded model and its tokenizer, the commit a run describes, and
how a result file is written. Serving benchmarks add ``bench/_server.py`` (launch a server,
talk to it) on top of this; no benchmark imports another for any of it.

Scripts import it by bare name (``from _common import ...``): running ``python bench/x.py``
puts ``bench/`` first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from sgl_pic.oracle import Oracle

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"
if str(ROOT) not in sys.path:  # the package, when it is not installed
    sys.path.insert(0, str(ROOT))


def embedded_path() -> Path:
    """The embedded model's directory (fetched into the cache on first use)."""
    from sgl_pic.model.embedded import ensure_embedded_model

    return ensure_embedded_model().path


def embedded_tokenizer() -> Any:
    """The embedded model's Hugging Face tokenizer (transformers imported on first use)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_path()))


class OracleModel(NamedTuple):
    """A model as the oracle studies (fidelity, diagnose, drift_estimate) use it."""

    path: Path  # its Hugging Face directory
    tokenizer: Any  # its Hugging Face tokenizer
    oracle: Oracle  # the reference forward over its weights


def load_oracle_model(model: Path | None) -> OracleModel:
    """``--model`` (None: the embedded model) loaded for the oracle studies; imports torch
    and transformers, so scripts call it after parsing their arguments."""
    import transformers

    from sgl_pic.oracle import Oracle, load_hf_model, weights_from_hf

    path = model or embedded_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return OracleModel(path, tokenizer, Oracle(weights_from_hf(load_hf_model(path))))


def git(*args: str, root: Path | None = None) -> str | None:
    """``git args`` in the checkout at ``root`` (this one, ``ROOT``, by default): its
    stripped output, None where git fails or is missing."""
    try:
        return subprocess.run(
            ["git", *args], cwd=root or ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class GitState(NamedTuple):
    """The commit a run describes: a figure belongs to the commit it ran at, and to none
    if the tree had changes. Nones outside a git checkout."""

    commit: str | None
    dirty: bool | None  # uncommitted changes (untracked files count unless told otherwise)


def git_state(untracked: bool = True, root: Path | None = None) -> GitState:
    """HEAD's commit and whether the tree has uncommitted changes, of the checkout at
    ``root`` (``ROOT`` by default); ``untracked=False`` leaves files git does not track
    out of ``dirty``."""
    flags = () if untracked else ("--untracked-files=no",)
    status = git("status", "--porcelain", *flags, root=root)
    return GitState(git("rev-parse", "HEAD", root=root), None if status is None else bool(status))


def server_env(root: Path = ROOT, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a server started from the checkout at ``root``:
    ``root`` first on PYTHONPATH (so the server runs that tree's code, installed or not),
    plus ``extra``."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile ``p`` in (0, 1] of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def write_json(path: str | Path, data: Any, indent: int = 1, newline: bool = False) -> Path:
    """Write ``data`` as JSON to ``path`` (whole or not at all), creating its directory;
    returns the path.
    ``indent``/``newline``: each result file keeps the layout it was committed in, so a
    rerun's diff shows changed figures only."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")  # a run killed mid-write leaves the old file
    tmp.write_text(json.dumps(data, indent=indent) + ("\n" if newline else ""))
    tmp.replace(out)
    return out


def add_data_option(parser: argparse.ArgumentParser, as_path: bool = False) -> None:
    """``--data``: the RAG examples (MuSiQue's shape), by default the shared MuSiQue dev
    set. ``as_path``: parsed to a Path; otherwise a string, as scripts that record
    ``vars(args)`` in their result need (JSON cannot write a Path)."""
    parser.add_argument(
        "--data",
        type=Path if as_path else str,
        default=DEFAULT_DATA if as_path else str(DEFAULT_DATA),
        help="RAG JSON (MuSiQue shape)",
    )


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """``--model``: a Hugging Face model directory; None (the default) means the embedded
    model (``embedded_path``), fetched only when the run starts."""
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: embedded)")


def add_out_option(
    parser: argparse.ArgumentParser, filename: str, as_path: bool = False, **kwargs: Any
) -> None:
    """``--out``: where the result goes, by default ``bench/results/<filename>``;
    ``as_path`` as for ``add_data_option``; ``kwargs`` go to ``add_argument`` (help)."""
    parser.add_argument(
        "--out",
        type=Path if as_path else str,
        default=RESULTS / filename if as_path else str(RESULTS / filename),
        **kwargs,
    )


def add_server_args_option(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    """``--server-args``: extra ``python -m sgl_pic.launch_server`` flags, one shell-quoted string;
    ``kwargs`` go to ``add_argument`` (help)."""
    parser.add_argument("--server-args", default="", **{"help": "extra server flags", **kwargs})
