"""Fidelity vs recompute budget of every selection policy, against exact full prefill.

Each MuSiQue example becomes a prompt of a system chunk, one chunk per passage and a
fresh question. Per example: full prefill (the reference, timed), independent KV of
every chunk (cached: not part of the reuse path's time), then for each policy and
budget the reuse path (assembly + selection + recomputation, timed) and its fidelity.
Time ratios are measured side by side in the same process for the same prompt.

The precision floor: exact prefill of the same model in bfloat16 and float16 (weights,
activations and KV in that dtype), measured against float32 exact prefill as every
policy is. Beyond the first token: teacher-forced KL and top-1 along exact prefill's
greedy continuation (up to its stop token), and ROUGE-L of the greedy answers.

Corrections beyond selection (``ENCODINGS``: passages encoded after a prefix) and more
sink tokens run beside the policies; ``--depth`` adds budgets that follow depth
(``bench/depth_budget.py``: a token set per layer, shrinking with depth) over independent
and system-prefix chunk KV, and ``--variants`` runs only the rows it names. Every
query_aware result also records its first-token KL to full reuse and to query_aware at
its other budgets (``kl_to``), which ``bench/drift_target.py`` judges as drift estimates.

    python bench/fidelity.py --examples 20
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path

from _common import (  # noqa: E402
    add_data_option,
    add_model_option,
    add_out_option,
    git_state,
    load_oracle_model,
    write_json,
)
from depth_budget import SIGNALS, DepthSchedule, timed_depth_reuse  # noqa: E402

from sgl_pic.config import PicConfig  # noqa: E402
from sgl_pic.fidelity import (  # noqa: E402
    answer_f1,
    bootstrap_ci,
    chunk_drift,
    first_token_kl,
    greedy_agreement,
    kv_deviation,
    layer_freqs,
    oracle_in_dtype,
    position_fidelity,
    recall_at,
    rouge_l,
    teacher_forced_logits,
    top1_agrees,
    until_stop,
)
from sgl_pic.oracle import Oracle  # noqa: E402
from sgl_pic.oracle.forward import KVCache  # noqa: E402
from sgl_pic.oracle.oracle import ChunkKV  # noqa: E402
from sgl_pic.prompts import build_prompt, load_rag_examples, truncate_tokens  # noqa: E402
from sgl_pic.selection import (  # noqa: E402
    Selection,
    SelectionContext,
    SelectionPolicy,
    cachetune_ranking,
    finalize,
    make_policy,
)
from sgl_pic.selection.cacheblend import reused_candidates  # noqa: E402

TARGET_BUDGET = 0.15  # issue #11's budget: the oracle selection is made at it


# How the chunks' KV is encoded before reuse. "independent" is what the server stores;
# the others are corrections studied here (issue #46), each a candidate for phase 1:
# - "sink_prefix": each passage is encoded after the prompt's first token (the chat
#   template's start token, the real attention sink at position 0), whose KV is dropped,
#   so the passage's own first token is not encoded as a sink;
# - "system_prefix": each passage is encoded after the whole system chunk (APE's shared
#   prefix; the chunk's key would then name the system chunk too).
ENCODINGS = ("independent", "sink_prefix", "system_prefix")
SINK_PREFIX_TOKENS = 1


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    overrides: tuple[tuple[str, Any], ...]
    is_default: bool
    encoding: str = "independent"


def variants(sweep: bool) -> list[Variant]:
    """Every policy at its default budget, plus the points that separate them near 15%."""
    d = PicConfig()
    out = [
        Variant("full_recompute", "full_recompute", (), True),
        Variant("full_reuse", "full_reuse", (), True),
        Variant(f"epic k={d.epic_k}", "epic", (), True),
        Variant(f"cacheblend {d.cacheblend_ratio:.0%}", "cacheblend", (), True),
        Variant(f"daric n_avg={d.daric_n_avg:g}", "daric", (), True),
        Variant(f"cachetune {d.cachetune_r:.0%}", "cachetune", (), True),
        Variant(f"query_aware {d.qa_ratio:.0%} L{d.qa_layers}", "query_aware", (), True),
    ]
    if not sweep:
        return out
    # Kept to what separates the policies at ~15% (EPIC at the same budget, query_aware's
    # depth and budget); the older sweep points of EPIC, CacheBlend and DARIC are in the
    # diagnosis (bench/results/diagnosis.json) and earlier fidelity.json commits.
    out.append(Variant("epic k=39", "epic", (("epic_k", 39),), False))
    for layers in (4, 8, 16):
        out.append(
            Variant(
                f"query_aware {d.qa_ratio:.0%} L{layers}",
                "query_aware",
                (("qa_layers", layers),),
                False,
            )
        )
    for ratio in (0.05, 0.1, 0.3):
        out.append(
            Variant(
                f"query_aware {ratio:.0%} L{d.qa_layers}",
                "query_aware",
                (("qa_ratio", ratio),),
                False,
            )
        )
    # Corrections beyond selection (issue #46): more of each chunk's first tokens, and
    # the passages encoded after a prefix.
    out.append(
        Variant(
            f"query_aware {d.qa_ratio:.0%} L{d.qa_layers} sinks=4",
            "query_aware",
            (("qa_sink_tokens", 4),),
            False,
        )
    )
    for encoding in ENCODINGS[1:]:
        name = encoding.replace("_", " ")
        out.append(Variant(f"full_reuse, {name}", "full_reuse", (), False, encoding))
        out.append(
            Variant(
                f"query_aware {d.qa_ratio:.0%} L{d.qa_layers}, {name}",
                "query_aware",
                (),
                False,
                encoding,
            )
        )
    return out


def encode_chunks(
    oracle: Oracle,
    ids: torch.Tensor,  # [N] the prompt
    layout: Any,
    encodings: Sequence[str],
    ranker: Any,
) -> dict[str, list[ChunkKV]]:
    """Every chunk's KV under each of ``encodings`` (see ENCODINGS). The first chunk sits
    at position 0, where its independent KV is exact: it is encoded once, serves every
    encoding, and is the prefix of the others."""
    first = layout.chunks[0]
    system = oracle.encode_chunk(ids[first.start : first.end], ranker=ranker)
    prefixes = {
        "independent": None,
        "sink_prefix": KVCache(
            system.kv.k[:, :SINK_PREFIX_TOKENS].clone(),
            system.kv.v[:, :SINK_PREFIX_TOKENS].clone(),
        ),
        "system_prefix": system.kv,
    }
    out = {}
    for encoding in encodings:
        if encoding not in prefixes:
            raise ValueError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
        prefix = prefixes[encoding]
        out[encoding] = [system] + [
            oracle.encode_chunk(ids[s.start : s.end], prefix=prefix, ranker=ranker)
            for s in layout.chunks[1:]
        ]
    return out


ORACLE_VARIANT = Variant(
    f"oracle deviation x attention {TARGET_BUDGET:.0%}", "oracle_selection", (), False
)
FLOOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def floor_variant(dtype: str) -> Variant:
    """Exact prefill of the model in ``dtype``: the drift a GPU user accepts already."""
    return Variant(f"exact {dtype}", f"exact_{dtype}", (), False)


def is_floor(policy: str) -> bool:
    return policy.startswith("exact_")


class TimedReuse(NamedTuple):
    kv: KVCache
    logits: torch.Tensor  # [vocab]
    computed: Selection
    seconds: float  # assembly + selection + recomputation
    selection_s: float  # the policy's select(), signals (deviation, probe) included
    # Chunk rows computed, summed over layers, over (chunk tokens x layers): where the set
    # differs by layer (depth budgets); None where one set runs every layer.
    layer_fraction: float | None = None


DEPTH_POLICY = "query_aware_depth"
# Budgets that follow depth (bench/depth_budget.py), each at a mean of 15% over layers.
DEPTH_SCHEDULES = tuple(
    DepthSchedule(first, last, signal)
    for first, last in ((0.25, 0.05), (0.30, 0.0), (0.20, 0.10))
    for signal in SIGNALS
)


def depth_variants() -> list[Variant]:
    """Each schedule over independent chunk KV, and over KV encoded after the system chunk
    (the best encoding measured): corrections may add up."""
    out = []
    for encoding, suffix in (("independent", ""), ("system_prefix", ", system prefix")):
        out += [
            Variant(s.label + suffix, DEPTH_POLICY, tuple(s._asdict().items()), False, encoding)
            for s in DEPTH_SCHEDULES
        ]
    return out


def select_variants(every: list[Variant], labels: list[str] | None) -> list[Variant]:
    """The variants named in ``labels`` (as the table prints them), in their usual order;
    all of them for None."""
    if labels is None:
        return every
    unknown = sorted(set(labels) - {v.label for v in every})
    if unknown:
        known = "; ".join(v.label for v in every)
        raise SystemExit(f"--variants: unknown {unknown}; known here: {known}")
    return [v for v in every if v.label in labels]


def _timed_depth(
    oracle: Oracle,
    ids: torch.Tensor,
    layout: Any,
    chunks: list[Any],
    config: PicConfig,
    var: Variant,
) -> TimedReuse:
    res, seconds, selection_s = timed_depth_reuse(
        oracle, ids, layout, chunks, config, DepthSchedule(**dict(var.overrides))
    )
    fraction = sum(res.chunk_rows) / (len(res.chunk_rows) * layout.num_reusable)
    return TimedReuse(res.kv, res.logits, res.computed, seconds, selection_s, fraction)


def _timed_reuse(
    oracle: Oracle, ids: torch.Tensor, layout: Any, chunks: list[Any], policy: SelectionPolicy
) -> TimedReuse:
    """``Oracle.reuse`` step by step, with the selection timed on its own."""
    t0 = time.perf_counter()
    assembled = oracle.assemble(ids, layout, chunks)
    ctx = SelectionContext(
        layout=layout,
        rankings=tuple(c.ranking for c in chunks),
        deviation=lambda: oracle.first_layer_deviation(ids, layout, assembled),
        query_attention=lambda: oracle.query_attention(
            ids, layout, assembled, policy.config.qa_layers
        ),
    )
    t1 = time.perf_counter()
    chosen = finalize(policy.select(ctx), layout)
    t2 = time.perf_counter()
    res = oracle.recompute(ids, assembled, chosen)
    return TimedReuse(res.kv, res.logits, res.computed, time.perf_counter() - t0, t2 - t1)


def _oracle_selection(
    oracle: Oracle, ids: torch.Tensor, layout: Any, chunks: list[Any], full: Any, budget: float
) -> TimedReuse:
    """The diagnosis's best oracle (bench/diagnose.py): the reused tokens of largest true
    K/V deviation from full prefill times the question's full-prefill attention to them.
    Known only after a full prefill: a reference point, not a policy (its time is not a
    cost anyone could pay)."""
    from diagnose import deviation_scores, tail_pass, top_k

    t0 = time.perf_counter()
    assembled = oracle.assemble(ids, layout, chunks)
    cand = reused_candidates(SelectionContext(layout))
    fresh = torch.tensor(layout.fresh_indices(), dtype=torch.int64)
    attention, _ = tail_pass(oracle, ids, full.kv, fresh)
    score = deviation_scores(full.kv, assembled, cand)["raw"] * attention.mean((0, 1))
    t1 = time.perf_counter()
    sel = top_k(score, cand, round(budget * layout.num_reusable))
    res = oracle.recompute(ids, assembled, finalize(sel, layout))
    return TimedReuse(res.kv, res.logits, res.computed, time.perf_counter() - t0, t1 - t0)


def _timed_floor(low: Oracle, ids: torch.Tensor) -> TimedReuse:
    """Exact prefill of ``low`` (the model in a lower dtype), timed like a reuse path."""
    t0 = time.perf_counter()
    res = low.prefill(ids)
    every = Selection(torch.arange(ids.numel()))
    return TimedReuse(res.kv, res.logits, every, time.perf_counter() - t0, 0.0)


def stop_ids(tokenizer: Any) -> frozenset[int]:
    """Tokens that end an answer: the tokenizer's EOS and the chat template's end of
    turn, where the vocabulary has one."""
    eos = tokenizer.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    end_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_turn, int) and end_turn != tokenizer.unk_token_id:
        ids.add(end_turn)
    return frozenset(ids)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, cpu_started = time.perf_counter(), time.process_time()
    state = git_state()  # the code that runs is the tree's now, whatever HEAD is at the end
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model_path, tokenizer, oracle = load_oracle_model(args.model)
    stops = stop_ids(tokenizer)
    floors = {name: oracle_in_dtype(oracle, FLOOR_DTYPES[name]) for name in args.floors}
    examples = load_rag_examples(args.data)[args.first : args.first + args.examples]
    base = PicConfig()
    alpha = base.cachetune_alpha
    all_variants = select_variants(
        variants(not args.no_sweep) + (depth_variants() if args.depth else []), args.variants
    )
    run_variants = all_variants + ([ORACLE_VARIANT] if args.oracle_selection else [])
    floor_variants = [floor_variant(name) for name in floors]
    new, cont = args.new_tokens, args.continuation_tokens
    generated = max(new, cont)
    rows: list[dict[str, Any]] = []
    recalls: list[dict[str, float]] = []

    def ranker(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cachetune_ranking(k, v, alpha)

    bar = tqdm(total=len(examples) * (len(all_variants) + len(floors)), desc="fidelity", unit="run")
    for ex_i, ex in enumerate(examples):
        passages = [truncate_tokens(tokenizer, p, args.passage_tokens) for p in ex.passages]
        prompt = build_prompt(tokenizer, passages[: args.passages], ex.question)
        ids, layout = prompt.token_ids, prompt.layout

        t0 = time.perf_counter()
        full = oracle.prefill(ids)
        t_full = time.perf_counter() - t0
        encoded = encode_chunks(
            oracle, ids, layout, list(dict.fromkeys(v.encoding for v in all_variants)), ranker
        )
        chunks = encoded["independent"]
        recalls.append(_ranking_recall(oracle, layout, full, chunks, base.cachetune_r))
        results = []
        for var in all_variants:
            if var.policy == DEPTH_POLICY:
                enc = encoded[var.encoding]
                results.append(_timed_depth(oracle, ids, layout, enc, base, var))
            else:
                policy = make_policy(base.with_overrides(policy=var.policy, **dict(var.overrides)))
                results.append(_timed_reuse(oracle, ids, layout, encoded[var.encoding], policy))
            bar.update(1)
        # Drift estimates the serving path could afford, compared after the run: how far
        # this result's first token is from full reuse of the same chunks (one pass of the
        # fresh tokens; the probe already runs its first layers) and from query_aware at
        # other budgets (an embedded pair, as ODE solvers estimate their error).
        family = {
            var.label: (var.encoding, res.logits)
            for var, res in zip(all_variants, results, strict=True)
            if var.policy in ("full_reuse", "query_aware")
            and set(dict(var.overrides)) <= {"qa_ratio"}
        }
        if args.oracle_selection:
            results.append(_oracle_selection(oracle, ids, layout, chunks, full, TARGET_BUDGET))
        # One batched greedy decode of the reference and every variant (same prompt
        # length): decoding is weight-bandwidth bound, so this costs about one decode.
        continuations = list(
            oracle.generate_batch(
                [full.kv] + [r.kv for r in results],
                torch.stack([full.logits] + [r.logits for r in results]),
                generated,
            )
        )
        # The floors decode in their own dtype, as a GPU serving that dtype would.
        tested = [(oracle, r) for r in results]
        for low in floors.values():
            res = _timed_floor(low, ids)
            tested.append((low, res))
            continuations.append(low.generate(res.kv, res.logits, generated))
            bar.update(1)
        ref_tokens = continuations[0]
        # Teacher forcing follows exact prefill's answer through its stop token; ROUGE-L
        # compares the answers without it. Tokens after a stop are no part of an answer.
        forced = until_stop(ref_tokens[:cont], stops, keep_stop=True)
        ref_answer = until_stop(ref_tokens[:cont], stops).tolist()
        ref_forced = teacher_forced_logits(oracle, full.kv, full.logits, forced)
        f1_full = answer_f1(
            tokenizer.decode(ref_tokens[:new], skip_special_tokens=True), ex.answers
        )
        for var, (path, res), tokens in zip(
            run_variants + floor_variants, tested, continuations[1:], strict=True
        ):
            computed = res.computed.indices
            in_chunks = sum(
                int(((computed >= s.start) & (computed < s.end)).sum()) for s in layout.chunks
            )
            fraction, computed_fraction = in_chunks / layout.num_reusable, None
            if res.layer_fraction is not None:  # by layer: chunk rows vary, fresh rows do not
                fraction = res.layer_fraction
                fresh = layout.num_tokens - layout.num_reusable
                computed_fraction = (fraction * layout.num_reusable + fresh) / layout.num_tokens
            tf = position_fidelity(
                ref_forced, teacher_forced_logits(path, res.kv, res.logits, forced)
            )
            answer = tokenizer.decode(tokens[:new], skip_special_tokens=True)
            rows.append(
                {
                    "example": args.first + ex_i,
                    "variant": var.label,
                    "policy": var.policy,
                    "default": var.is_default,
                    "encoding": var.encoding,
                    "num_tokens": layout.num_tokens,
                    "num_chunks": len(layout.chunks),
                    "recompute_fraction": fraction,
                    "computed_fraction": (
                        computed.numel() / layout.num_tokens
                        if computed_fraction is None
                        else computed_fraction
                    ),
                    "kl": first_token_kl(full.logits, res.logits),
                    "kl_to": (
                        {
                            label: first_token_kl(res.logits, logits)
                            for label, (enc, logits) in family.items()
                            if enc == var.encoding and label != var.label
                        }
                        if var.label in family
                        else None
                    ),
                    "top1": float(top1_agrees(full.logits, res.logits)),
                    "greedy_agreement": greedy_agreement(ref_tokens[:new], tokens[:new]),
                    "kv_deviation": kv_deviation(full.kv, res.kv),
                    "f1": answer_f1(answer, ex.answers),
                    "f1_full": f1_full,
                    "tf_kl": tf.kl,
                    "tf_top1": tf.top1,
                    "tf_positions": tf.positions,
                    "rouge_l": rouge_l(ref_answer, until_stop(tokens[:cont], stops).tolist()),
                    "time_ratio": res.seconds / t_full,
                    "selection_s": res.selection_s,
                    "selection_share": res.selection_s / res.seconds,
                    "t_full_s": t_full,
                    "t_reuse_s": res.seconds,
                }
            )
    bar.close()
    return {
        "benchmark": "fidelity",
        "model": str(model_path),
        "data": str(args.data),
        "examples": len(examples),
        "first": args.first,
        "passages": args.passages,
        "passage_tokens": args.passage_tokens,
        "new_tokens": new,
        "continuation_tokens": cont,
        "floors": list(floors),
        "stop_ids": sorted(stops),
        "threads": args.threads,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
        # CPU time of the process: on a shared machine, what predicts another run's length.
        "cpu_s": time.process_time() - cpu_started,
        "commit": state._asdict(),
        "summary": summarize(rows, run_variants + floor_variants),
        "cachetune_recall": {key: statistics.fmean(r[key] for r in recalls) for key in recalls[0]},
        "cachetune_recall_rows": recalls,
        "rows": rows,
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs over disjoint example ranges of one commit and settings (runs
    side by side use the cores a single run leaves idle); wall_s is the longest part's."""
    same = (
        "commit",
        "model",
        "data",
        "passages",
        "passage_tokens",
        "new_tokens",
        "continuation_tokens",
        "floors",
        "threads",
    )
    for part in parts[1:]:
        for key in same:
            if part.get(key) != parts[0].get(key):
                raise ValueError(
                    f"parts differ in {key}: {part.get(key)!r} vs {parts[0].get(key)!r}"
                )
    seen = [r["example"] for part in parts for r in part["rows"] if r["variant"] == "full_reuse"]
    if len(seen) != len(set(seen)):
        raise ValueError("parts overlap in examples")
    out = dict(parts[0])
    rows = [r for part in parts for r in part["rows"]]
    recalls = [r for part in parts for r in part["cachetune_recall_rows"]]
    variants_ = [
        Variant(s["variant"], s["policy"], (), s["default"], s.get("encoding", "independent"))
        for s in out["summary"]
    ]
    out.update(
        examples=sum(part["examples"] for part in parts),
        first=min(part["first"] for part in parts),
        wall_s=max(part["wall_s"] for part in parts),
        parts=len(parts),
        summary=summarize(rows, variants_),
        cachetune_recall={k: statistics.fmean(r[k] for r in recalls) for k in recalls[0]},
        cachetune_recall_rows=recalls,
        rows=rows,
    )
    return out


def _ranking_recall(
    oracle: Oracle,
    layout: Any,
    full: Any,
    chunks: list[Any],
    fraction: float,
) -> dict[str, float]:
    """CacheTune E.2 on this prompt: Recall@fraction of the high-drift tokens of the
    chunks after the first, for the stored ranking, its negation, the first tokens of
    each chunk, and the random expectation."""
    # The first chunk sits at position 0: its independent KV is exact, no drift.
    later, spans = chunks[1:], layout.chunks[1:]
    drift = chunk_drift(full.kv, later, spans, layer_freqs(oracle.w))
    ranking = torch.cat([c.ranking for c in later])
    first = torch.cat([-torch.arange(s.length, dtype=torch.float32) for s in spans])
    k = max(1, round(fraction * drift.numel()))
    return {
        "ranking": recall_at(drift, ranking, fraction),
        "negated_ranking": recall_at(drift, -ranking, fraction),
        "first_tokens_of_chunk": recall_at(drift, first, fraction),
        "random_expectation": k / drift.numel(),
    }


MEANS = (
    "recompute_fraction",
    "computed_fraction",
    "kl",
    "top1",
    "greedy_agreement",
    "kv_deviation",
    "f1",
    "tf_kl",
    "tf_top1",
    "tf_positions",
    "rouge_l",
    "time_ratio",
    "selection_s",
    "selection_share",
)
# Every fidelity figure gets a 95% bootstrap interval over the examples.
WITH_CI = ("kl", "top1", "greedy_agreement", "kv_deviation", "f1", "tf_kl", "tf_top1", "rouge_l")


def summarize(rows: list[dict[str, Any]], all_variants: list[Variant]) -> list[dict[str, Any]]:
    """Per variant: the mean of every figure over the examples, a 95% bootstrap interval of
    each fidelity figure, and, where the bfloat16 floor ran, first-token KL and
    teacher-forced KL as multiples of the floor's ("reuse drift = N x bf16 drift")."""
    out = []
    for var in all_variants:
        mine = [r for r in rows if r["variant"] == var.label]
        entry: dict[str, Any] = {
            "variant": var.label,
            "policy": var.policy,
            "default": var.is_default,
            "encoding": var.encoding,
            "floor": is_floor(var.policy),
        }
        for k in MEANS:
            if all(k in r for r in mine):  # results of older commits lack the newer figures
                entry[k] = statistics.fmean(r[k] for r in mine)
        for k in WITH_CI:
            if k in entry:
                entry[k + "_ci95"] = bootstrap_ci([r[k] for r in mine])
        out.append(entry)
    floor = next((e for e in out if e["policy"] == "exact_bfloat16"), None)
    for entry in out:
        for k in ("kl", "tf_kl"):
            if floor is not None and floor.get(k, 0.0) > 0 and k in entry:
                entry[f"{k}_over_bfloat16"] = entry[k] / floor[k]
    return out


def _ci(entry: dict[str, Any], key: str, digits: int) -> str:
    if key not in entry:
        return "-"
    lo, hi = entry[key + "_ci95"]
    return f"{entry[key]:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['examples']} examples, mean prompt "
        f"{statistics.fmean(r['num_tokens'] for r in result['rows']):.0f} tokens"
    )
    header = (
        f"{'variant':<34}{'recomp':>8}{'KL [95% CI]':>26}{'x bf16':>8}"
        f"{'greedy [95% CI]':>20}{'top1':>6}{'select':>8}{'time':>6}"
    )
    print(header)
    print("-" * len(header))
    for s in result["summary"]:
        ratio = s.get("kl_over_bfloat16")
        print(
            f"{s['variant']:<34}{s['recompute_fraction']:>8.3f}{_ci(s, 'kl', 4):>26}"
            f"{'-' if ratio is None else f'{ratio:.1f}':>8}"
            f"{_ci(s, 'greedy_agreement', 2):>20}{s['top1']:>6.2f}"
            f"{s['selection_share']:>8.1%}{s['time_ratio']:>6.2f}"
        )
    if "tf_kl" in result["summary"][0]:
        cont = result.get("continuation_tokens")
        print(
            f"\nAlong exact prefill's greedy answer (at most {cont} tokens, through its stop "
            "token): teacher-forced top-1 and KL per position; ROUGE-L of the greedy answers"
        )
        header = f"{'variant':<34}{'TF top1':>22}{'TF KL':>26}{'x bf16':>8}{'ROUGE-L':>22}"
        print(header)
        print("-" * len(header))
        for s in result["summary"]:
            ratio = s.get("tf_kl_over_bfloat16")
            print(
                f"{s['variant']:<34}{_ci(s, 'tf_top1', 3):>22}{_ci(s, 'tf_kl', 4):>26}"
                f"{'-' if ratio is None else f'{ratio:.1f}':>8}{_ci(s, 'rouge_l', 3):>22}"
            )
        positions = statistics.fmean(r["tf_positions"] for r in result["rows"])
        print(f"mean teacher-forced positions per example: {positions:.1f}")
    rec = result["cachetune_recall"]
    print(
        "\nCacheTune E.2 Recall@15% of high-drift tokens: "
        + ", ".join(f"{k} {v:.3f}" for k, v in rec.items())
    )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("kl", "first-token KL to full prefill (nats, lower is better)"),
        ("greedy_agreement", f"greedy agreement, first {result['new_tokens']} tokens"),
    ]
    if "tf_top1" in result["summary"][0]:
        panels.append(("tf_top1", "teacher-forced top-1 agreement along exact's answer"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for s in result["summary"]:
        by_policy.setdefault(s["policy"], []).append(s)
    for policy, entries in sorted(by_policy.items()):
        entries.sort(key=lambda e: e["recompute_fraction"])
        xs = [e["recompute_fraction"] for e in entries]
        for ax, (key, _) in zip(axes, panels, strict=True):
            if is_floor(policy):  # no budget: a level every policy is read against
                ax.axhline(entries[0][key], ls=":", color="k" if "bf" in policy else "grey")
                ax.text(0.0, entries[0][key], f" {policy}", fontsize=7, va="bottom")
            else:
                ax.plot(xs, [e[key] for e in entries], marker="o", label=policy)
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.set_xlabel("fraction of chunk tokens recomputed")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("symlog", linthresh=1e-3)
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"Fidelity vs recompute ({result['examples']} MuSiQue examples, SmolLM2-135M, oracle)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_option(p, as_path=True)
    add_model_option(p)
    p.add_argument("--examples", type=int, default=20)
    p.add_argument("--passages", type=int, default=8, help="passages (chunks) per prompt")
    p.add_argument(
        "--passage-tokens", type=int, default=256, help="truncate passages (0 = keep whole)"
    )
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared")
    p.add_argument(
        "--continuation-tokens",
        type=int,
        default=64,
        help="greedy answer length for teacher-forced fidelity and ROUGE-L",
    )
    p.add_argument(
        "--floors",
        nargs="*",
        choices=sorted(FLOOR_DTYPES),
        default=["bfloat16", "float16"],
        help="dtypes whose exact prefill is measured against float32 (none: no floor rows)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-sweep", action="store_true", help="default budgets only")
    p.add_argument(
        "--oracle-selection",
        action="store_true",
        # argparse %-formats help: a literal percent sign is written %%.
        help=f"add the oracle selection at {TARGET_BUDGET:.0%}% (needs bench/diagnose.py)",
    )
    p.add_argument(
        "--depth",
        action="store_true",
        help="add budgets that follow depth (bench/depth_budget.py), each at 15%% over layers",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="labels (as the table prints them, one argument each): run only these",
    )
    p.add_argument("--first", type=int, default=0, help="index of the first example")
    p.add_argument(
        "--merge", type=Path, nargs="+", default=None, help="merge these results into --out"
    )
    add_out_option(p, "fidelity.json", as_path=True)
    args = p.parse_args(argv)
    if args.examples < 1 or args.passages < 1 or args.first < 0:
        p.error("--examples and --passages must be >= 1, --first >= 0")
    if args.new_tokens < 1 or args.continuation_tokens < 1:
        p.error("--new-tokens and --continuation-tokens must be >= 1")
    if args.merge:
        result = merge([json.loads(path.read_text()) for path in args.merge])
    else:
        result = run(args)
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print_table(result)
    print(f"\nwall time {result['wall_s']:.0f} s")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
