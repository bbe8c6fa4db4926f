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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _server import Client, shifted

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"
POLICIES = ("full_recompute", "daric", "epic", "cachetune", "cacheblend", "full_reuse")
TOP = 20


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


@contextmanager
def serve(tree: Path, args: list[str]) -> Any:
    import os

    from sgl_pic.server_process import server_process

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    with (
        tempfile.TemporaryDirectory(prefix="sgl_pic_cmp_") as disk,
        server_process(
            [*args, "--pic-disk-cache-dir", disk],
            420.0,
            env=env,
            cwd=str(tree),
            log_prefix="sgl_pic_cmp_server_",
        ) as proc,
    ):
        yield Client(proc.url, proc.log_path)


def requests_for(tok: Any, examples: int, passages: int, passage_tokens: int) -> list[dict]:
    from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens

    out = []
    pool = [ex for ex in load_rag_examples(DATA) if len(ex.passages) >= passages][:examples]
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
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare_paths.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from sgl_pic.model.embedded import ensure_embedded_model

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_model().path))
    reqs = requests_for(tok, args.examples, args.passages, args.passage_tokens)
    server_args = args.server_args.split()
    old_commit = _git("rev-parse", args.old_ref)
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
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
        "old_commit": old_commit,
        "requests": len(records),
        "tokens_equal": sum(r["tokens_equal"] for r in records),
        "max_top_logprob_abs_diff": worst,
        "within_1e-4": sum(r["top_logprob_max_abs_diff"] <= 1e-4 for r in records),
        "records": records,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "records"}, indent=2))
    if report["tokens_equal"] != len(records) or worst > 1e-4:
        sys.exit("outputs differ between the two trees beyond 1e-4")


if __name__ == "__main__":
    main()
