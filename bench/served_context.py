"""Served fidelity of chunks encoded alone and after the prompt's first chunk
(``--pic-chunk-context none`` and ``first_chunk``), each against its server's exact prefill.

    python bench/served_context.py --examples 40

One server per setting, otherwise at its defaults. Each MuSiQue example becomes the
prompt ``bench/fidelity.py`` builds (a system chunk, a chunk per passage, the question).
Per example and server: the prompt unmarked (exact prefill: a plain request never reads
chunked KV), then marked with its passages in reverse order (their chunks are stored; the
system chunk becomes device prefix), then marked as built. For the last, its first-token
KL from exact prefill over the whole vocabulary (a one-token request asking for every
token's log-probability) and the greedy agreement of 16 tokens; the same KL for full
reuse. The two settings are paired per example: the ratio of their mean KLs, and of each
to full reuse of chunks encoded alone, with paired bootstrap intervals. Writes
``bench/results/served_context.json`` (per-example records, the commit, whether the tree
was dirty).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import (  # noqa: E402
    add_data_option,
    add_out_option,
    embedded_tokenizer,
    git_state,
    write_json,
)
from _server import delta, launch  # noqa: E402

from sgl_pic.fidelity import (  # noqa: E402
    bootstrap_ci,
    first_token_kl,
    greedy_agreement,
    paired_ratio_ci,
)
from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens  # noqa: E402

SETTINGS = ("none", "first_chunk")
NEW_TOKENS = 16


def body(
    ids: list[int], spans: list[list[int]] | None, n: int, top: int = 0, policy: str = ""
) -> dict:
    out: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n},
    }
    if top:
        out.update(return_logprob=True, top_logprobs_num=top)
    if spans is not None:
        out["pic"] = {"chunks": spans, **({"config": {"policy": policy}} if policy else {})}
    return out


def first_logprobs(out: dict[str, Any]) -> dict[int, float]:
    """The first output token's log-probability of every token the server returned."""
    return {int(t): float(lp) for lp, t, _ in out["meta_info"]["output_top_logprobs"][0]}


def kl(ref: dict[int, float], test: dict[int, float]) -> float:
    """``fidelity.first_token_kl`` (exact || reuse) in nats over the tokens ``ref`` lists
    (the whole vocabulary here), from their log-probabilities."""
    ids = sorted(ref)
    return first_token_kl(torch.tensor([ref[t] for t in ids]), torch.tensor([test[t] for t in ids]))


def agreement(ref: list[int], test: list[int]) -> float:
    """``fidelity.greedy_agreement`` of two servers' output ids."""
    return greedy_agreement(torch.tensor(ref), torch.tensor(test))


Case = tuple[list[int], list[list[int]], tuple[list[int], list[list[int]]]]


def prompts(args: argparse.Namespace, tok: Any) -> list[Case]:
    """(ids, spans, (ids, spans) of the warm-up prompt) per example, tokenized by
    ``tok``; the warm-up prompt is the same chunks with the passages reversed, same
    question."""
    out = []
    examples = load_rag_examples(args.data)[args.first : args.first + args.examples]
    for ex in examples:
        passages = [truncate_tokens(tok, p, args.passage_tokens) for p in ex.passages]
        passages = passages[: args.passages]
        prompt = build_prompt(tok, passages, ex.question)
        warm = build_prompt(tok, passages[::-1], ex.question)
        ids = prompt.token_ids.tolist()
        spans = [[s.start, s.end] for s in prompt.layout.chunks]
        wspans = [[s.start, s.end] for s in warm.layout.chunks]
        out.append((ids, spans, (warm.token_ids.tolist(), wspans)))
    return out


def run_setting(setting: str, cases: list[Case], vocab: int) -> list[dict[str, Any]]:
    rows = []
    with launch(["--pic-chunk-context", setting]) as client:
        for i, (ids, spans, (warm_ids, warm_spans)) in enumerate(cases):
            _, exact = client.generate(body(ids, None, 1, vocab))
            _, exact_n = client.generate(body(ids, None, NEW_TOKENS))
            client.generate(body(warm_ids, warm_spans, 1))
            before = client.metrics()
            _, reused = client.generate(body(ids, spans, 1, vocab))
            d = delta(before, client.metrics())
            _, reused_n = client.generate(body(ids, spans, NEW_TOKENS))
            _, full = client.generate(body(ids, spans, 1, vocab, "full_reuse"))
            rows.append(
                {
                    "example": i,
                    "setting": setting,
                    "prompt_tokens": len(ids),
                    "cached_tokens": reused["meta_info"]["cached_tokens"],
                    "first_token_kl": kl(first_logprobs(exact), first_logprobs(reused)),
                    "greedy_agreement": agreement(exact_n["output_ids"], reused_n["output_ids"]),
                    "full_reuse_kl": kl(first_logprobs(exact), first_logprobs(full)),
                    "recomputed_tokens": d.get("sgl_pic_recomputed_tokens_total", 0.0),
                    "reused_tokens": d.get("sgl_pic_reused_tokens_total", 0.0),
                    "misses": d.get("sgl_pic_chunk_misses_total", 0.0),
                }
            )
            print(f"{setting} {i}: KL {rows[-1]['first_token_kl']:.4f}", flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {s: [r for r in rows if r["setting"] == s] for s in SETTINGS}
    out: dict[str, Any] = {}
    for s, rs in by.items():
        kls = [r["first_token_kl"] for r in rs]
        agree = [r["greedy_agreement"] for r in rs]
        out[s] = {
            "first_token_kl": statistics.fmean(kls),
            "first_token_kl_ci": bootstrap_ci(kls),
            "greedy_agreement": statistics.fmean(agree),
            "greedy_agreement_ci": bootstrap_ci(agree),
        }
        out[s]["full_reuse_kl"] = statistics.fmean(r["full_reuse_kl"] for r in rs)
        out[s]["recomputed_fraction"] = sum(r["recomputed_tokens"] for r in rs) / sum(
            r["recomputed_tokens"] + r["reused_tokens"] for r in rs
        )
    # Against the KL of full reuse of chunks encoded alone (what issue #46 reads), and
    # one setting against the other, paired per example.
    full = [r["full_reuse_kl"] for r in by["none"]]
    for s, rs in by.items():
        kls = [r["first_token_kl"] for r in rs]
        out[s]["kl_over_full_reuse"] = sum(kls) / max(sum(full), 1e-12)
        out[s]["kl_over_full_reuse_ci"] = paired_ratio_ci(kls, full)
    num = [r["first_token_kl"] for r in by["first_chunk"]]
    den = [r["first_token_kl"] for r in by["none"]]
    out["kl_first_chunk_over_none"] = sum(num) / max(sum(den), 1e-12)
    out["kl_first_chunk_over_none_ci"] = paired_ratio_ci(num, den)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_option(parser)
    add_out_option(parser, "served_context.json")
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--first", type=int, default=0)
    # bench/fidelity.py's prompts.
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--passage-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    state = git_state()
    tok = embedded_tokenizer()  # loaded once: the prompts and the vocabulary's size
    cases = prompts(args, tok)
    vocab = len(tok)
    rows = [r for s in SETTINGS for r in run_setting(s, cases, vocab)]
    result = {
        "commit": state.commit,
        "dirty": state.dirty,
        "args": vars(args),
        "summary": summary(rows),
        "rows": rows,
    }
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
