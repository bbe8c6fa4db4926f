"""The chunk path of this tree against an earlier one: same requests, same cache states.

    python bench/compare_paths.py --old-ref a49d103 [--examples 4]

Exports the old commit into a temporary directory (``git archive``), serves it and then
this tree with the same flags, and sends both the same sequence of chunked requests
(every policy, chunks reused in new orders, so device hits, misses and the device prefix
occur alike). Per request it compares the output tokens and the prefill's top-20
logprobs (the first generated token's distribution). Results go to
bench/results/compare_paths.json (--out) with both commits and per-request records.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import (
    DEFAULT_DATA,
    ROOT,
    add_out_option,
    add_server_args_option,
    embedded_tokenizer,
    git,
    git_state,
    write_json,
)
from _server import Client, launch, shifted

POLICIES = (
    "full_recompute",
    "daric",
    "epic",
    "cachetune",
    "cacheblend",
    "full_reuse",
    "query_aware",
)
TOP = 20


@contextmanager
def serve(tree: Path, args: list[str]) -> Iterator[Client]:
    """A server running the code of the checkout at ``tree``, on a fresh disk tier."""
    with (
        tempfile.TemporaryDirectory(prefix="sgl_pic_cmp_") as disk,
        launch(
            [*args, "--pic-disk-cache-dir", disk],
            420.0,
            root=tree,
            log_prefix="sgl_pic_cmp_server_",
            quiet=True,
        ) as client,
    ):
        yield client


def requests_for(tok: Any, examples: int, passages: int, passage_tokens: int) -> list[dict]:
    from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens

    out = []
    pool = [ex for ex in load_rag_examples(DEFAULT_DATA) if len(ex.passages) >= passages][:examples]
    for i, ex in enumerate(pool):
        texts = [truncate_tokens(tok, p, passage_tokens) for p in ex.passages[:passages]]
        for order in (texts, texts[::-1]):
            prompt = build_prompt(tok, order, ex.question)
            ids = prompt.token_ids.tolist()
            spans = [[s.start, s.end] for s in prompt.layout.chunks]
            for policy in POLICIES:
                # Fixed headers: both servers see identical token ids.
                head = tok.encode(f"[{i}:{policy}:{len(out)}] ", add_special_tokens=False)
                out.append(
                    {
                        "input_ids": head + ids,
                        "pic": {"chunks": shifted(spans, len(head)), "config": {"policy": policy}},
                        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                        "return_logprob": True,
                        "top_logprobs_num": TOP,
                    }
                )
    return out


def run(client: Client, reqs: list[dict]) -> list[dict]:
    outs = []
    for body in reqs:
        _, resp = client.generate(body)
        meta = resp["meta_info"]
        outs.append(
            {
                "output_ids": resp["output_ids"],
                "top": {int(t): lp for lp, t, _ in meta["output_top_logprobs"][0]},
            }
        )
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-ref", required=True)
    ap.add_argument("--examples", type=int, default=3)
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=200)
    ap.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest top-20 prefill logprob difference allowed between the trees",
    )
    add_server_args_option(ap)
    add_out_option(ap, "compare_paths.json")
    args = ap.parse_args()
    state = git_state()  # the new tree's code is read at its server's start, not at the end
    tok = embedded_tokenizer()
    reqs = requests_for(tok, args.examples, args.passages, args.passage_tokens)
    server_args = args.server_args.split()
    old_commit = git("rev-parse", args.old_ref)
    if old_commit is None:
        sys.exit(f"--old-ref {args.old_ref!r} names no commit of this checkout")
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="sgl_pic_old_tree_") as old_tree:
        archive = subprocess.run(
            ["git", "archive", old_commit], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", old_tree], input=archive, check=True)
        for name, tree in (("old", Path(old_tree)), ("new", ROOT)):
            with serve(tree, server_args) as client:
                results[name] = run(client, reqs)
            print(f"{name}: {len(results[name])} requests", flush=True)
    records = []
    for i, (body, a, b) in enumerate(zip(reqs, results["old"], results["new"], strict=True)):
        common = sorted(set(a["top"]) & set(b["top"]))
        diff = max((abs(a["top"][t] - b["top"][t]) for t in common), default=float("inf"))
        records.append(
            {
                "request": i,
                "policy": body["pic"]["config"]["policy"],
                "tokens_equal": a["output_ids"] == b["output_ids"],
                "top_logprob_max_abs_diff": diff,
                "top_ids_shared": len(common),
            }
        )
    worst = max(r["top_logprob_max_abs_diff"] for r in records)
    report = {
        "git_commit": state.commit,
        "git_dirty": state.dirty,
        "old_commit": old_commit,
        "requests": len(records),
        "tokens_equal": sum(r["tokens_equal"] for r in records),
        "max_top_logprob_abs_diff": worst,
        "tolerance": args.tolerance,
        "within_tolerance": sum(r["top_logprob_max_abs_diff"] <= args.tolerance for r in records),
        "records": records,
    }
    write_json(args.out, report, indent=2, newline=True)
    print(json.dumps({k: v for k, v in report.items() if k != "records"}, indent=2))
    if report["tokens_equal"] != len(records) or worst > args.tolerance:
        sys.exit(f"outputs differ between the two trees beyond {args.tolerance:g}")


if __name__ == "__main__":
    main()
