"""Chunked chat prompts on each template fixture: how many token ids differ from the plain
tokenization of the same text (the cost of tokenizing each piece on its own).

Over generated agent requests (tests/support/chat_templates.py: tool subsets and
orders, tool calls and results, several turns, a final assistant message, template
options), per fixture of tests/support/templates and the embedded model's own template:
the prompts' text must equal the template's rendering (``text_mismatches``: 0), and the
token ids differ only in small blocks at piece boundaries, where a piece's first or last
token would have merged with its neighbour's text. Writes
bench/results/template_boundaries.json.

    PYTHONPATH=$PWD python bench/template_boundaries.py [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import add_out_option, git_state, write_json  # noqa: E402

from tests.support.chat_templates import EMBEDDED, FAMILIES, boundary_counts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    add_out_option(ap, "template_boundaries.json")
    args = ap.parse_args()
    commit, dirty = git_state()
    report = {
        "git_commit": commit,
        "dirty": dirty,
        "requests_per_template": args.requests,
        "seed": args.seed,
        "templates": {
            n: boundary_counts(n, args.requests, args.seed) for n in [*FAMILIES, EMBEDDED]
        },
    }
    write_json(args.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
