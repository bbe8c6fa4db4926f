"""One-shot serving check: the server at its defaults serves reuse, and reuse is sound.

    python bench/serve_check.py [--out-dir DIR] [--tolerance NATS] [-- SERVER ARGS...]

For a machine with SGLang installed (a GPU one above all, where nothing else here runs the
chunk path through FlashInfer, FA3 or triton); it runs the same way on the CPU with the
embedded model. It starts ``python -m sgl_pic.launch_server`` with no arguments but the
ones after ``--`` (e.g. ``-- --model-path meta-llama/Llama-3.1-8B-Instruct``), so it checks
what a user gets by default, then:

    supported     ``sgl_pic_unsupported{reason}`` is 0 for every reason: reuse is on;
    exact         each prompt marked in chunks at ``full_recompute`` (every token goes
                  through chunk lookup, phase 1 for misses, and phase 2) against the same
                  token ids unmarked (marked requests share one tenant's ``extra_key``,
                  each plain one has its own, so neither finds the other's prefix): the
                  first generated token is the same and its top log-probabilities agree
                  within ``--tolerance`` nats (the chunk path's
                  batches against one SGLang forward: kernel order and precision, nothing
                  else);
    reuse         the same documents in another order at the server's default policy: at
                  least one chunk hit, fewer tokens computed than the prompt's, no failure
                  or fallback; its first-token log-probability gap to exact is reported;
    metrics       the server's ``sgl_pic_*`` series before and after, printed.

Writes serve_check.json (the checks, per-request records, the commit and whether the tree
was dirty) to --out-dir. Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import git_state, write_json  # noqa: E402
from _server import Client, delta, launch, metric  # noqa: E402

DOCS = (
    "Lyon sits where the Rhone meets the Saone; its old town is a UNESCO site. Silk "
    "weaving made the city rich, and its covered passages let weavers carry cloth dry "
    "through the rain. Today it is known for its food, its markets and its festival of "
    "lights each December.",
    "Kyoto was Japan's capital for a thousand years and has many wooden temples. Its "
    "gardens of raked gravel and moss draw visitors in every season, and the geisha "
    "district of Gion keeps its old tea houses. Spared from bombing in the war, it kept "
    "much of its historic center.",
    "Quito, the capital of Ecuador, lies almost exactly on the equator. At 2,850 metres "
    "it is one of the highest capitals in the world, ringed by volcanoes such as "
    "Pichincha. Its colonial center was among the first places listed as a World "
    "Heritage Site.",
    "Tromso in Norway sees the midnight sun from May to July each year. In winter the "
    "sun does not rise for weeks, and the northern lights are often seen above the "
    "fjords. The city has a university, a cathedral of glass and a museum of polar "
    "exploration.",
)
QUESTIONS = ("Which city lies on the equator?", "Where do two rivers meet?")
TOP = 5  # top log-probabilities compared per first token


def build_prompt(tokenizer: Any, order: list[int], question: str) -> tuple[list[int], list]:
    """Token ids and chunk spans: a fresh header, the documents in ``order`` (each
    tokenized on its own, as the server tokenizes a chunk), the question."""

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    toks = ids(f"{secrets.token_hex(4)} notes\n")
    spans = []
    for i in order:
        t = ids(DOCS[i] + "\n")
        spans.append([len(toks), len(toks) + len(t)])
        toks += t
    return toks + ids(f"Question: {question}\nAnswer:"), spans


# Every marked request of a run is one tenant (its chunks are reused only inside it); each
# plain request gets a key of its own, so it finds no prefix a marked one left.
TENANT = f"serve-check-{secrets.token_hex(4)}"


def request(toks: list[int], spans: list | None, policy: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": toks,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        "return_logprob": True,
        "top_logprobs_num": TOP,
        "extra_key": TENANT if spans is not None else f"plain-{secrets.token_hex(4)}",
    }
    if spans is not None:
        body["pic"] = {"chunks": spans, **({"config": {"policy": policy}} if policy else {})}
    return body


def first_token(out: dict[str, Any]) -> tuple[int, dict[int, float]]:
    """(the first generated token, its position's top log-probabilities by token id)."""
    meta = out["meta_info"]
    token = int(meta["output_token_logprobs"][0][1])
    tops = {int(t): float(lp) for lp, t, *_ in meta["output_top_logprobs"][0]}
    return token, tops


def gap(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest log-probability difference over the tokens both top lists hold."""
    common = a.keys() & b.keys()
    return max((abs(a[t] - b[t]) for t in common), default=math.inf)


def run(client: Client, tokenizer: Any, tolerance: float) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    m0 = client.metrics()
    unsupported = {k: v for k, v in m0.items() if k.startswith("sgl_pic_unsupported") and v}
    checks["supported"] = {"ok": not unsupported, "unsupported": unsupported}

    def send(kind: str, toks: list[int], spans: list | None, policy: str | None) -> dict:
        before = client.metrics()
        dt, out = client.generate(request(toks, spans, policy))
        moved = {k: v for k, v in delta(before, client.metrics()).items() if v}
        token, tops = first_token(out)
        rec = {
            "kind": kind,
            "prompt_tokens": len(toks),
            "seconds": round(dt, 4),
            "first_token": token,
            "top_logprobs": tops,
            "metrics": moved,
        }
        records.append(rec)
        return rec

    exact_ok = True
    for i, q in enumerate(QUESTIONS):
        order = [0, 1, 2] if i == 0 else [2, 0, 3]
        toks, spans = build_prompt(tokenizer, order, q)
        plain = send("plain", toks, None, None)
        marked = send("full_recompute", toks, spans, "full_recompute")
        g = gap(plain["top_logprobs"], marked["top_logprobs"])
        marked["gap_to_plain"] = g
        went_through = metric(marked["metrics"], "sgl_pic_requests_total") >= 1
        same = plain["first_token"] == marked["first_token"]
        exact_ok &= same and g <= tolerance and went_through
    checks["exact"] = {
        "ok": exact_ok,
        "tolerance": tolerance,
        "gaps": [r.get("gap_to_plain") for r in records if "gap_to_plain" in r],
    }

    toks, spans = build_prompt(tokenizer, [3, 1, 0, 2], QUESTIONS[0])
    plain = send("plain", toks, None, None)
    reused = send("default_policy", toks, spans, None)
    moved = reused["metrics"]
    hits = sum(v for k, v in moved.items() if k.startswith("sgl_pic_chunk_hits_total"))
    computed = metric(moved, "sgl_pic_recomputed_tokens_total")
    bad = metric(moved, "sgl_pic_failures_total") + metric(moved, "sgl_pic_fallbacks_total")
    reused["gap_to_plain"] = gap(plain["top_logprobs"], reused["top_logprobs"])
    checks["reuse"] = {
        "ok": hits >= 1 and computed < len(toks) and bad == 0,
        "chunk_hits": hits,
        "recomputed_tokens": computed,
        "prompt_tokens": len(toks),
        "failures_and_fallbacks": bad,
        "first_token_equal": plain["first_token"] == reused["first_token"],
        "gap_to_plain": reused["gap_to_plain"],
    }
    checks["metrics"] = {"ok": True, "after": client.metrics()}
    return {"checks": checks, "records": records}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="largest first-token log-probability gap (nats) between full_recompute "
        "through the chunk path and plain prefill",
    )
    args = p.parse_args(own)
    from transformers import AutoTokenizer

    model = _model_path(server_args)
    tokenizer = AutoTokenizer.from_pretrained(model)
    commit, dirty = git_state()
    t0 = time.monotonic()
    with launch(server_args) as client:
        result = run(client, tokenizer, args.tolerance)
    result.update(
        commit=commit,
        dirty=dirty,
        server_args=server_args,
        model=model,
        seconds=round(time.monotonic() - t0, 1),
    )
    for name, check in result["checks"].items():
        if name == "metrics":
            continue
        shown = {k: v for k, v in check.items() if k != "ok"}
        print(f"{name:<10} {'OK' if check['ok'] else 'FAIL'}  {json.dumps(shown)}")
    print("metrics after:")
    for k, v in sorted(result["checks"]["metrics"]["after"].items()):
        if v:
            print(f"  {k} {v:g}")
    write_json(Path(args.out_dir) / "serve_check.json", result, newline=True)
    return 0 if all(c["ok"] for c in result["checks"].values()) else 1


def _model_path(server_args: list[str]) -> str:
    for flag in ("--model-path", "--model"):
        for i, a in enumerate(server_args):
            if a == flag and i + 1 < len(server_args):
                return server_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    from sgl_pic.model.embedded import ensure_embedded_model

    return str(ensure_embedded_model().path)


if __name__ == "__main__":
    sys.exit(main())
