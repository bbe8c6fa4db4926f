"""Phase 2's planned KV reads against exact prefill's, on FlashInfer's and FA3's plans,
before and after the read cap (``--pic-phase2-read-budget``), and the cap's fidelity.

Reads are counted by ``sgl_pic.engine.kv_reads`` (the plans SGLang 0.5.23 makes, KV tokens
per KV head and layer; checked against the backends' real planning in
tests/binding/test_backend_reads.py). Each request is planned as its own batch: one
sub-request per run (``runs_of`` of the selection, no merge gap), and its exact prefill
as one sub-request; the ratio is the first over the second. "Capped" runs are
``select.bound_runs`` at each ``--budgets`` value, binding prompts of at least
``--min-tokens`` (both default to the server's), with the cap's tiles for each model
shape; the first budget is the fidelity run's.

Selections are the default policy's (query_aware, its default settings), made by the
oracle over the embedded model (SmolLM2-135M) on MuSiQue dev examples from ``--first``
(40: the held-out examples 40-79 of bench/RESULTS.md):

- 8k: real selections on prompts of up to ``--long-tokens`` tokens (the model's context
  is 8192): the system chunk, then whole passages of examples i, i+1, ... until the next
  would not fit, then example i's question;
- 32k and 128k: no model here reads that far, so those selections are tiled from the 8k
  ones: the first 8k prompt's system chunk, then the passage chunks of the 8k prompts in
  order (each with the positions its real selection chose inside it), cycling, until the
  next chunk would not fit before the first prompt's question, which ends the prompt
  (recomputed whole, as fresh text is). The density and clustering of each chunk's
  selection are real; how the question's attention spreads over 32k or 128k tokens is not
  measured.

Model shapes (query heads per KV head, head_dim) are those of public checkpoints; the
selections do not depend on them, the cap's tile and the plans do.

Fidelity: the first-token KL to exact prefill of query_aware's selection and of that
selection capped for the embedded model's shape (group 3, head_dim 64) at the first
budget, both recomputed by the oracle, on ``--examples`` held-out prompts of the fidelity
benchmark's default shape (8 passages of at most 256 tokens) and on the first
``--long-fidelity`` 8k prompts.

    python bench/phase2_reads.py --threads 2                 # the server's defaults
    python bench/phase2_reads.py --selections bench/results/phase2_reads.json  # no 8k runs
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import (  # noqa: E402
    add_data_option,
    add_model_option,
    add_out_option,
    git_state,
    load_oracle_model,
    write_json,
)

from sgl_pic.binding.settings import PicServerSettings  # noqa: E402
from sgl_pic.config import PicConfig  # noqa: E402
from sgl_pic.core.runs import Run, runs_of
from sgl_pic.engine.kv_reads import (  # noqa: E402
    BACKENDS,
    AttnShape,
    SubRequest,
    exact_reads,
    planned_reads,
    read_cap,
)
from sgl_pic.engine.select import bound_runs  # noqa: E402
from sgl_pic.fidelity import bootstrap_ci, first_token_kl  # noqa: E402
from sgl_pic.layout import PromptLayout  # noqa: E402
from sgl_pic.oracle import Oracle  # noqa: E402
from sgl_pic.prompts import (  # noqa: E402
    ChunkedPrompt,
    RagExample,
    build_prompt,
    load_rag_examples,
    truncate_tokens,
)
from sgl_pic.selection import Selection, SelectionContext, finalize, make_policy  # noqa: E402

SHAPES = {
    "Llama-3.1-8B (32 q / 8 kv heads, d 128)": AttnShape(4, 128),
    "Qwen2.5-7B (28 q / 4 kv heads, d 128)": AttnShape(7, 128),
    "Llama-2-7B (MHA, d 128)": AttnShape(1, 128),
    "SmolLM2-135M (9 q / 3 kv heads, d 64)": AttnShape(3, 64),
}
EMBEDDED_SHAPE = AttnShape(3, 64)  # SmolLM2-135M's: the fidelity run's cap
LENGTHS = (8192, 32768, 131072)


class Chosen(NamedTuple):
    """A prompt's selection, by piece: the system chunk, each passage chunk and the
    question, each as (length, offsets chosen inside it)."""

    head: tuple[int, list[int]]
    chunks: list[tuple[int, list[int]]]
    tail: tuple[int, list[int]]


def selector(oracle: Oracle, config: PicConfig) -> Oracle:
    """The oracle over the model's first ``qa_layers`` layers: query_aware's signal reads
    only those (a layer's keys depend on no later layer), so it selects the same
    positions, in a fraction of the time. Its KV serves selection only."""
    layers = oracle.w.layers[: config.qa_layers]
    return Oracle(dataclasses.replace(oracle.w, layers=layers), oracle.kv_dtype)


def select(oracle: Oracle, prompt: ChunkedPrompt, config: PicConfig) -> tuple[Any, torch.Tensor]:
    """(assembled KV, # [k] positions the default policy recomputes, finalized)."""
    ids, layout = prompt.token_ids, prompt.layout
    chunks = [oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    assembled = oracle.assemble(ids, layout, chunks)
    policy = make_policy(config)
    ctx = SelectionContext(
        layout=layout,
        query_attention=lambda: oracle.query_attention(ids, layout, assembled, config.qa_layers),
    )
    return assembled, finalize(policy.select(ctx), layout).indices


def pieces(layout: PromptLayout, sel: torch.Tensor) -> Chosen:
    chosen = set(sel.tolist())

    def inside(start: int, end: int) -> tuple[int, list[int]]:
        return end - start, [p - start for p in range(start, end) if p in chosen]

    spans = layout.chunks
    return Chosen(
        inside(spans[0].start, spans[0].end),
        [inside(s.start, s.end) for s in spans[1:]],
        inside(spans[-1].end, layout.num_tokens),
    )


def long_prompt(tokenizer: Any, examples: list[RagExample], first: int, limit: int) -> Any:
    """System chunk, whole passages of examples first, first + 1, ... while they fit in
    ``limit`` tokens with example ``first``'s question."""
    passages: list[str] = []
    prompt = build_prompt(tokenizer, passages, examples[first].question)
    for ex in examples[first:]:
        for text in ex.passages:
            trial = build_prompt(tokenizer, [*passages, text], examples[first].question)
            if trial.layout.num_tokens > limit:
                return prompt
            passages.append(text)
            prompt = trial
    return prompt


def tiled(chosen: list[Chosen], n: int) -> tuple[int, list[int]]:
    """(length, positions) of a prompt of at most ``n`` tokens tiled from ``chosen``."""
    (head_len, head_sel), (tail_len, tail_sel) = chosen[0].head, chosen[0].tail
    positions = list(head_sel)
    pos = head_len
    ring = [c for ch in chosen for c in ch.chunks]
    i = 0
    while pos + ring[i % len(ring)][0] + tail_len <= n:
        length, offsets = ring[i % len(ring)]
        positions += [pos + o for o in offsets]
        pos += length
        i += 1
    positions += [pos + o for o in tail_sel]
    return pos + tail_len, positions


def whole(ch: Chosen) -> tuple[int, list[int]]:
    """(length, positions) of the real prompt ``ch`` describes."""
    positions, pos = [], 0
    for length, offsets in [ch.head, *ch.chunks, ch.tail]:
        positions += [pos + o for o in offsets]
        pos += length
    return pos, positions


def read_records(
    label: str, n: int, sel: list[int], budgets: list[float], min_tokens: int
) -> list[dict[str, Any]]:
    """One record per budget and model shape: runs, recomputed tokens and each backend's
    planned reads over exact prefill's, uncapped and capped (from ``min_tokens`` on)."""
    runs = runs_of(torch.tensor(sel, dtype=torch.int64))
    out = []
    for budget, (name, shape) in itertools.product(budgets, SHAPES.items()):
        cap = read_cap(shape.group, shape.head_dim, budget, min_tokens)
        capped = bound_runs(list(runs), 0, n, cap)
        rec: dict[str, Any] = {
            "case": label,
            "tokens": n,
            "shape": name,
            "group": shape.group,
            "head_dim": shape.head_dim,
            "cap_tiles": None if cap is None else list(cap.tiles),
            "budget": budget,
            "min_tokens": min_tokens,
            "binds": cap is not None and cap.binds(n),
            "runs": len(runs),
            "runs_capped": len(capped),
            "recomputed": len(sel) / n,
            "recomputed_capped": covered(capped) / n,
        }
        for backend in BACKENDS:
            exact = exact_reads(backend, n, shape)
            for key, rs in (("", runs), ("_capped", capped)):
                subs = [SubRequest(r.start, r.end - r.start) for r in rs]
                rec[f"{backend}_ratio{key}"] = planned_reads(backend, subs, shape) / exact
            rec[f"{backend}_exact_reads"] = exact
        out.append(rec)
    return out


def covered(runs: list[Run]) -> int:
    return sum(r.end - r.start for r in runs)


def fidelity_rows(
    oracle: Oracle,
    prompts: list[tuple[int, ChunkedPrompt]],
    budget: float,
    min_tokens: int,
    on_row: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """Per (example, prompt): query_aware's first-token KL to exact prefill, uncapped and
    capped at ``budget`` (from ``min_tokens`` on) for the embedded model's shape;
    ``on_row`` sees the rows so far after each."""
    config = PicConfig()
    cap = read_cap(*EMBEDDED_SHAPE, budget, min_tokens)
    rows = []
    for i, prompt in prompts:
        ids, n = prompt.token_ids, prompt.layout.num_tokens
        full = oracle.prefill(ids)
        assembled, sel = select(oracle, prompt, config)
        runs = runs_of(sel)
        capped = bound_runs(list(runs), 0, n, cap)
        sel_capped = torch.cat([torch.arange(r.start, r.end) for r in capped])
        assert set(sel.tolist()) <= set(sel_capped.tolist())
        kl = first_token_kl(full.logits, oracle.recompute(ids, assembled, Selection(sel)).logits)
        if sel_capped.numel() == sel.numel():
            kl_capped = kl
        else:
            res = oracle.recompute(ids, assembled, Selection(sel_capped))
            kl_capped = first_token_kl(full.logits, res.logits)
        rows.append(
            {
                "example": i,
                "tokens": n,
                "recomputed": sel.numel() / n,
                "recomputed_capped": sel_capped.numel() / n,
                "runs": len(runs),
                "runs_capped": len(capped),
                "kl": kl,
                "kl_capped": kl_capped,
            }
        )
        print(f"fidelity {i}: {rows[-1]}", flush=True)
        on_row(rows)
    return rows


def held_out(
    tokenizer: Any, examples: list[RagExample], args: argparse.Namespace
) -> list[tuple[int, ChunkedPrompt]]:
    """The fidelity benchmark's default prompts (8 passages of at most 256 tokens) of
    ``--examples`` held-out examples from ``--first``."""
    out = []
    for i in range(args.first, args.first + args.examples):
        ex = examples[i]
        passages = [truncate_tokens(tokenizer, p, 256) for p in ex.passages[:8]]
        out.append((i, build_prompt(tokenizer, passages, ex.question)))
    return out


def summarize_fidelity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    kl = [r["kl"] for r in rows]
    capped = [r["kl_capped"] for r in rows]
    diff = [c - k for k, c in zip(kl, capped, strict=True)]
    return {
        "examples": len(rows),
        "kl_mean": statistics.fmean(kl),
        "kl_ci": bootstrap_ci(kl),
        "kl_capped_mean": statistics.fmean(capped),
        "kl_capped_ci": bootstrap_ci(capped),
        "kl_capped_minus_kl_mean": statistics.fmean(diff),
        "kl_capped_minus_kl_ci": bootstrap_ci(diff),
        "worse": sum(d > 1e-9 for d in diff),
        "recomputed_mean": statistics.fmean(r["recomputed"] for r in rows),
        "recomputed_capped_mean": statistics.fmean(r["recomputed_capped"] for r in rows),
    }


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    started = time.perf_counter()
    state = git_state()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model_path, tokenizer, oracle = load_oracle_model(args.model)
    examples = load_rag_examples(args.data)
    chosen: list[Chosen] = []
    records: list[dict[str, Any]] = []
    if args.selections is not None:
        chosen = [Chosen(*c) for c in json.loads(args.selections.read_text())["selections"]]
    else:
        for i in range(args.first, args.first + args.long_prompts):
            prompt = long_prompt(tokenizer, examples, i, args.long_tokens)
            _, sel = select(selector(oracle, PicConfig()), prompt, PicConfig())
            chosen.append(pieces(prompt.layout, sel))
            print(f"selection {i}: {prompt.layout.num_tokens} tokens", flush=True)
    for k, ch in enumerate(chosen):
        n, sel = whole(ch)
        records += read_records(f"real {args.first + k}", n, sel, args.budgets, args.min_tokens)
    for length in LENGTHS[1:]:
        for k in range(len(chosen)):
            # Each tiled prompt starts from a different real one.
            n, sel = tiled(chosen[k:] + chosen[:k], length)
            label = f"tiled {length} from {args.first + k}"
            records += read_records(label, n, sel, args.budgets, args.min_tokens)
    result: dict[str, Any] = {
        "benchmark": "phase2_reads",
        "commit": state.commit,
        "dirty": state.dirty,
        "model": str(model_path),
        "data": str(args.data),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shapes": {k: v._asdict() for k, v in SHAPES.items()},
        "summary": summarize_reads(records),
        "records": records,
        "selections": [list(c) for c in chosen],
        # Written again after each fidelity prompt: a run stopped early keeps those done.
        "complete": False,
        "fidelity": None,
        "fidelity_rows": [],
        "fidelity_long": None,
        "fidelity_long_rows": [],
        "wall_s": time.perf_counter() - started,
    }
    save(result)

    def progress(key: str) -> Callable[[list[dict[str, Any]]], None]:
        def on_row(rows: list[dict[str, Any]]) -> None:
            result[key], result[f"{key}_rows"] = summarize_fidelity(rows), rows
            result["wall_s"] = time.perf_counter() - started
            save(result)

        return on_row

    budget = args.budgets[0]
    held = held_out(tokenizer, examples, args)
    fidelity_rows(oracle, held, budget, args.min_tokens, progress("fidelity"))
    long = [
        (i, long_prompt(tokenizer, examples, i, args.long_tokens))
        for i in range(args.first, args.first + args.long_fidelity)
    ]
    fidelity_rows(oracle, long, budget, args.min_tokens, progress("fidelity_long"))
    result["complete"] = True
    result["wall_s"] = time.perf_counter() - started
    save(result)
    return result


def summarize_reads(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget, length class (8k real, 32k, 128k tiled) and shape: the mean and max of
    each ratio and the mean recomputed fractions."""
    out = []
    keys = [f"{b}_ratio{s}" for b in BACKENDS for s in ("", "_capped")]
    classes: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for r in records:
        cls = "8k real" if r["case"].startswith("real") else r["case"].split(" from")[0]
        classes.setdefault((r["budget"], cls, r["shape"]), []).append(r)
    for (budget, cls, shape), rs in classes.items():
        entry: dict[str, Any] = {"budget": budget, "class": cls, "shape": shape}
        entry["prompts"] = len(rs)
        entry["tokens_mean"] = statistics.fmean(r["tokens"] for r in rs)
        for key in keys + ["recomputed", "recomputed_capped", "runs", "runs_capped"]:
            entry[f"{key}_mean"] = statistics.fmean(r[key] for r in rs)
        for key in keys:
            entry[f"{key}_max"] = max(r[key] for r in rs)
        out.append(entry)
    return out


def print_table(result: dict[str, Any]) -> None:
    print(
        "| budget | prompts | model shape | runs / token | recomputed | FlashInfer | FA3 "
        "| runs / token, capped | recomputed, capped | FlashInfer, capped (max) "
        "| FA3, capped (max) |"
    )
    print("| --- " * 11 + "|")
    for e in result["summary"]:
        t = e["tokens_mean"]
        print(
            f"| {e['budget']} | {e['class']} ({e['prompts']}, {t / 1024:.1f}k) | {e['shape']} "
            f"| {e['runs_mean'] / t:.3f} | {e['recomputed_mean']:.3f} "
            f"| {e['flashinfer_ratio_mean']:.2f} | {e['fa3_ratio_mean']:.2f} "
            f"| {e['runs_capped_mean'] / t:.4f} | {e['recomputed_capped_mean']:.3f} "
            f"| {e['flashinfer_ratio_capped_mean']:.2f} ({e['flashinfer_ratio_capped_max']:.2f}) "
            f"| {e['fa3_ratio_capped_mean']:.2f} ({e['fa3_ratio_capped_max']:.2f}) |"
        )
    for key in ("fidelity", "fidelity_long"):
        fid = result[key]
        if not fid:
            continue
        ci = fid["kl_capped_minus_kl_ci"]
        print(
            f"\n{key} ({fid['examples']} held-out prompts): KL {fid['kl_mean']:.4f} "
            f"{[round(x, 4) for x in fid['kl_ci']]}, capped {fid['kl_capped_mean']:.4f} "
            f"{[round(x, 4) for x in fid['kl_capped_ci']]}; capped - uncapped "
            f"{fid['kl_capped_minus_kl_mean']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}], worse on "
            f"{fid['worse']}; recomputed {fid['recomputed_mean']:.3f} -> "
            f"{fid['recomputed_capped_mean']:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(p, as_path=True)
    add_model_option(p)
    p.add_argument("--first", type=int, default=40, help="first held-out example")
    p.add_argument("--long-prompts", type=int, default=8, help="8k prompts selected for real")
    p.add_argument("--long-tokens", type=int, default=8192, help="length limit of those")
    p.add_argument("--examples", type=int, default=20, help="held-out prompts for fidelity")
    p.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[PicServerSettings(PicConfig()).phase2_read_budget],
        help="the cap's read budgets (--pic-phase2-read-budget; default: the server's); "
        "fidelity runs at the first",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=PicServerSettings(PicConfig()).phase2_read_min_tokens,
        help="shortest request the cap binds (--pic-phase2-read-min-tokens; default: the server's)",
    )
    p.add_argument(
        "--long-fidelity", type=int, default=2, help="of the 8k prompts, those for fidelity"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--selections",
        type=Path,
        default=None,
        help="take the 8k selections from this earlier result instead of the model",
    )
    add_out_option(p, "phase2_reads.json", as_path=True)
    args = p.parse_args(argv)
    if not all(b == 0 or 1 <= b < math.inf for b in args.budgets):
        p.error("--budgets must be 0 or at least 1")
    result = run(args, lambda r: write_json(args.out, r))
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
