"""Fidelity of reused-KV answers to full prefill: the quality measures of both papers.

At 135M parameters task accuracy is near zero, so quality is measured as closeness to
the exact full-prefill answer: first-token KL, top-1 and greedy agreement, KV deviation
(DARIC Eq. 2); along the exact continuation, teacher-forced KL and top-1 per position
(which do not compound as greedy agreement does), and ROUGE-L of greedy outputs. Answer
F1 uses LongBench's normalisation. The precision floor is the same measures for exact
prefill of the model in a lower dtype (``oracle_in_dtype``) against float32.
"""

from __future__ import annotations

import dataclasses
import random
import re
import statistics
import string
from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from sgl_pic.layout import Span
from sgl_pic.oracle.forward import KVCache, empty_kv, forward_tokens, logits_of
from sgl_pic.oracle.model_weights import ModelWeights
from sgl_pic.oracle.oracle import ChunkKV, Oracle
from sgl_pic.rope import rerotate


def first_token_kl(
    ref_logits: torch.Tensor,  # [vocab] full prefill
    test_logits: torch.Tensor,  # [vocab] reuse path
) -> float:
    """KL(P_ref || P_test) of the next-token distributions, in nats."""
    ref = torch.log_softmax(ref_logits.to(torch.float64), dim=-1)
    test = torch.log_softmax(test_logits.to(torch.float64), dim=-1)
    return float(torch.sum(ref.exp() * (ref - test)).clamp_min(0.0))


def top1_agrees(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> bool:  # [vocab] each
    return int(torch.argmax(ref_logits)) == int(torch.argmax(test_logits))


def greedy_agreement(
    ref_tokens: torch.Tensor,  # [n] greedy continuation of full prefill
    test_tokens: torch.Tensor,  # [n] greedy continuation of the reuse path
) -> float:
    """Fraction of the n positions whose tokens match before the first divergence
    (1.0 = identical continuation). Positions after a divergence count as misses:
    a different early token makes the rest a different answer."""
    n = ref_tokens.numel()
    if test_tokens.numel() != n or n == 0:
        raise ValueError(f"need equal non-empty continuations, got {n} and {test_tokens.numel()}")
    diff = (ref_tokens != test_tokens).nonzero()
    return 1.0 if diff.numel() == 0 else int(diff[0, 0]) / n


def kv_deviation(ref: KVCache, test: KVCache) -> float:
    """DARIC Eq. 2 averaged over layers and tokens: ||N(K') - N(K)|| + ||N(V') - N(V)||
    with N the L2 normalisation of each token's K (or V) over heads and dims."""
    if ref.k.shape != test.k.shape:
        raise ValueError(f"KV shapes differ: {tuple(ref.k.shape)} vs {tuple(test.k.shape)}")

    def dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [L, N, H, D] each
        a = torch.nn.functional.normalize(a.flatten(2).to(torch.float32), dim=-1)
        b = torch.nn.functional.normalize(b.flatten(2).to(torch.float32), dim=-1)
        return (a - b).norm(dim=-1).to(torch.float64)  # [L, N]

    return float((dist(ref.k, test.k) + dist(ref.v, test.v)).mean())


def normalize_answer(text: str) -> str:
    """LongBench / SQuAD normalisation: lower case, no punctuation, no articles,
    single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token-level F1 of the prediction against any reference answer."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = Counter(pred) & Counter(gold)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred), same / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def token_drift(
    independent_k: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim] pre-RoPE
    independent_v: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
    full_k: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim] pre-RoPE, full context
    full_v: torch.Tensor,  # [num_layers, n, num_kv_heads, head_dim]
) -> torch.Tensor:
    """# [n] how far each token's independently encoded K/V lie from full-context K/V
    (CacheTune E.2): per-layer L2 distances of pre-RoPE keys and of values, each
    divided by that layer's largest distance, summed, averaged over layers."""
    dk = (independent_k - full_k).flatten(2).to(torch.float64).norm(dim=-1)  # [L, n]
    dv = (independent_v - full_v).flatten(2).to(torch.float64).norm(dim=-1)
    eps = torch.finfo(torch.float64).tiny
    dk = dk / dk.amax(dim=1, keepdim=True).clamp_min(eps)
    dv = dv / dv.amax(dim=1, keepdim=True).clamp_min(eps)
    return (dk + dv).mean(dim=0).to(torch.float32)


def layer_freqs(w: ModelWeights) -> list[torch.Tensor]:
    """Each layer's RoPE frequencies # [head_dim // 2] (``chunk_drift``'s tables)."""
    return [w.rope(li).inv_freq for li in range(w.num_layers)]


def chunk_drift(
    full: KVCache,  # [num_layers, N, num_kv_heads, head_dim] each, full-context prefill
    chunks: Sequence[ChunkKV],
    spans: Sequence[Span],
    layer_freqs: Sequence[torch.Tensor],  # num_layers x [head_dim // 2], each layer's table
) -> torch.Tensor:
    """# [sum of span lengths] ``token_drift`` of each chunk's independent KV against the
    full-context KV of its span, tokens in span order. Full-context keys are rotated back
    to position 0, each layer by its own RoPE table, so that both sides are compared
    before RoPE, as CacheTune E.2 does."""
    if len(chunks) != len(spans):
        raise ValueError(f"{len(chunks)} chunks for {len(spans)} spans")
    if len(layer_freqs) != full.k.shape[0]:
        raise ValueError(f"{len(layer_freqs)} RoPE tables for {full.k.shape[0]} layers")
    full_k, full_v = [], []
    for span in spans:
        pos = torch.arange(span.start, span.end)
        k = full.k[:, span.start : span.end]
        back = [
            rerotate(kl, pos, torch.zeros_like(pos), freq)
            for kl, freq in zip(k, layer_freqs, strict=True)
        ]
        full_k.append(torch.stack(back))
        full_v.append(full.v[:, span.start : span.end])
    return token_drift(
        torch.cat([c.pre_rope_k for c in chunks], 1),
        torch.cat([c.kv.v for c in chunks], 1),
        torch.cat(full_k, 1),
        torch.cat(full_v, 1),
    )


def recall_at(
    truth: torch.Tensor,  # [n] reference scores (e.g. drift), higher = more important
    predicted: torch.Tensor,  # [n] a selector's scores
    fraction: float,
) -> float:
    """|top-k(predicted) ∩ top-k(truth)| / k with k = round(fraction * n), at least 1.
    A random selector's expected recall is k / n."""
    if truth.shape != predicted.shape or truth.dim() != 1:
        raise ValueError(f"need two equal 1-D score vectors, got {truth.shape}, {predicted.shape}")
    k = max(1, round(fraction * truth.numel()))
    top_true = set(torch.topk(truth, k).indices.tolist())
    top_pred = set(torch.topk(predicted, k).indices.tolist())
    return len(top_true & top_pred) / k


def bootstrap_ci(values: Sequence[float], seed: int = 0, n: int = 2000) -> list[float]:
    """95% percentile bootstrap interval of the mean over examples, as [low, high]."""
    if not values:
        raise ValueError("a bootstrap interval needs at least one value")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return [means[int(0.025 * n)], means[int(0.975 * n) - 1]]


def paired_ratio_ci(
    num: Sequence[float], den: Sequence[float], seed: int = 0, n: int = 2000
) -> list[float]:
    """95% percentile bootstrap interval of sum(num) / sum(den) over examples, as [low,
    high]: examples resampled, both sums taken on the same resample (``num[i]`` and
    ``den[i]`` are one example's)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"need two equal non-empty lists, got {len(num)} and {len(den)}")
    rng = random.Random(seed)
    idx = range(len(num))
    draws = (rng.choices(idx, k=len(num)) for _ in range(n))
    ratios = sorted(sum(num[i] for i in d) / sum(den[i] for i in d) for d in draws)
    return [ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]]


def until_stop(
    tokens: torch.Tensor,  # [n] a greedy continuation
    stop_ids: Collection[int],
    keep_stop: bool = False,
) -> torch.Tensor:
    """# [m <= n] the tokens before the first stop token (through it when ``keep_stop``):
    a server ends the answer there, so what follows is no part of it."""
    hits = [i for i, t in enumerate(tokens.tolist()) if t in stop_ids]
    return tokens if not hits else tokens[: hits[0] + int(keep_stop)]


def rouge_l(ref_tokens: Sequence[int], test_tokens: Sequence[int]) -> float:
    """ROUGE-L F-measure (beta = 1) of two token sequences: with L their longest common
    subsequence, 2 P R / (P + R) for P = L / len(test), R = L / len(ref). Two empty
    sequences score 1, one empty sequence 0."""
    ref, test = list(ref_tokens), list(test_tokens)
    if not ref or not test:
        return float(not ref and not test)
    prev = [0] * (len(test) + 1)
    for a in ref:
        cur = [0] * (len(test) + 1)
        for j, b in enumerate(test, 1):
            cur[j] = prev[j - 1] + 1 if a == b else max(prev[j], cur[j - 1])
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(test), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


@torch.inference_mode()
def teacher_forced_logits(
    oracle: Oracle,
    kv: KVCache,  # [num_layers, N, num_kv_heads, head_dim] a prompt's KV (not modified)
    first_logits: torch.Tensor,  # [vocab] logits at the prompt's last position
    tokens: torch.Tensor,  # [T] the continuation fed, e.g. exact prefill's greedy one
) -> torch.Tensor:
    """# [T, vocab] float32: row t is the next-token distribution (logits) before
    ``tokens[t]``, with ``tokens[:t]`` fed after the prompt whatever this KV would have
    generated. Row 0 is ``first_logits``; rows 1.. come from one extend of
    ``tokens[:-1]`` over a copy of ``kv`` (causal, so equal to feeding them one by one)."""
    t, n = tokens.numel(), kv.num_tokens
    if t == 0:
        raise ValueError("teacher forcing needs at least one token")
    if t == 1:
        return first_logits[None].to(torch.float32)
    buf = empty_kv(oracle.w, n + t - 1, oracle.kv_dtype)
    buf.k[:, :n] = kv.k
    buf.v[:, :n] = kv.v
    pos = torch.arange(n, n + t - 1)
    out = forward_tokens(oracle.w, tokens[:-1], pos, pos, buf, torch.arange(n + t - 1))
    return torch.cat([first_logits[None].to(torch.float32), logits_of(oracle.w, out.hidden)])


class PositionFidelity(NamedTuple):
    kl: float  # mean over positions of KL(P_ref || P_test), nats
    top1: float  # fraction of positions whose argmax tokens agree
    positions: int


def position_fidelity(
    ref_logits: torch.Tensor,  # [T, vocab] exact prefill's teacher-forced logits
    test_logits: torch.Tensor,  # [T, vocab] the tested path's, along the same tokens
) -> PositionFidelity:
    """Teacher-forced fidelity: each position's ``first_token_kl`` and ``top1_agrees``,
    averaged over the positions."""
    if ref_logits.shape != test_logits.shape or ref_logits.dim() != 2:
        raise ValueError(
            f"need two equal [T, vocab] logits, got {ref_logits.shape}, {test_logits.shape}"
        )
    ref = torch.log_softmax(ref_logits.to(torch.float64), dim=-1)
    test = torch.log_softmax(test_logits.to(torch.float64), dim=-1)
    kl = (ref.exp() * (ref - test)).sum(-1).clamp_min(0.0)  # [T]
    agree = ref_logits.argmax(-1) == test_logits.argmax(-1)  # [T]
    return PositionFidelity(float(kl.mean()), float(agree.double().mean()), kl.numel())


def oracle_in_dtype(oracle: Oracle, dtype: torch.dtype) -> Oracle:
    """The same model with every weight and the KV in ``dtype`` (bfloat16 or float16:
    what a GPU serves), as loading the float32 checkpoint in that dtype gives. RoPE
    frequencies stay float32, as the model keeps them; ``oracle`` is not modified."""

    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(dtype)

    w = oracle.w
    layers = tuple(
        dataclasses.replace(
            layer, **{f.name: cast(getattr(layer, f.name)) for f in dataclasses.fields(layer)}
        )
        for layer in w.layers
    )
    low = dataclasses.replace(
        w,
        embed=cast(w.embed),
        layers=layers,
        final_norm=cast(w.final_norm),
        lm_head=cast(w.lm_head),
    )
    return Oracle(low, kv_dtype=dtype)
