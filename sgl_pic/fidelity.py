"""Fidelity of reused-KV answers to full prefill: the quality measures of both papers.

At 135M parameters task accuracy is near zero, so quality is measured as closeness to
the exact full-prefill answer: first-token KL, top-1 and greedy agreement, KV deviation
(DARIC Eq. 2). Answer F1 uses LongBench's normalisation.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch

from sgl_pic.layout import Span
from sgl_pic.oracle.forward import KVCache
from sgl_pic.oracle.oracle import ChunkKV
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


def chunk_drift(
    full: KVCache,  # [num_layers, N, num_kv_heads, head_dim] each, full-context prefill
    chunks: Sequence[ChunkKV],
    spans: Sequence[Span],
    inv_freq: torch.Tensor,  # [head_dim // 2]
) -> torch.Tensor:
    """# [sum of span lengths] ``token_drift`` of each chunk's independent KV against the
    full-context KV of its span, tokens in span order. Full-context keys are rotated back
    to position 0 so that both sides are compared before RoPE, as CacheTune E.2 does."""
    if len(chunks) != len(spans):
        raise ValueError(f"{len(chunks)} chunks for {len(spans)} spans")
    full_k, full_v = [], []
    for span in spans:
        pos = torch.arange(span.start, span.end)
        k = full.k[:, span.start : span.end]
        full_k.append(torch.stack([rerotate(kl, pos, torch.zeros_like(pos), inv_freq) for kl in k]))
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
