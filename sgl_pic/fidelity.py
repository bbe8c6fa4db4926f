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

from sgl_pic.oracle.forward import KVCache


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
        a = torch.nn.functional.normalize(a.flatten(2).to(torch.float64), dim=-1)
        b = torch.nn.functional.normalize(b.flatten(2).to(torch.float64), dim=-1)
        return (a - b).norm(dim=-1)  # [L, N]

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
