"""CacheTune's claim on real text (its Appendix E.2): the offline low-frequency ranking
covers the tokens whose KV drift most between independent and full-context encoding
better than random selection does.

Drift follows the paper's definition: pre-RoPE keys and values, distances normalised
within each layer. The claim is asserted as the paper states it and marked as a strict
expected failure with the numbers measured here: if a change to the ranking made it
hold, the strict marker turns that into a visible test failure to revisit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgl_pic.fidelity import chunk_drift, layer_freqs, recall_at
from sgl_pic.oracle import Oracle
from sgl_pic.prompts import build_prompt, load_rag_examples
from sgl_pic.selection import cachetune_ranking

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "musique_dev.json"


@pytest.mark.skipif(not DATA.is_file(), reason=f"{DATA} (the shared data set) is absent")
@pytest.mark.xfail(
    strict=True,
    reason=(
        "CacheTune E.2 does not reproduce on SmolLM2-135M: Recall@15% of the ranking is "
        "0.08-0.13 per example here (random: 0.15; the negated ranking: 0.31-0.40; the "
        "first tokens of each chunk: 0.34-0.49). The paper reports 0.86-0.90 on a 7B model."
    ),
)
def test_low_frequency_ranking_beats_random_recall(real_oracle: Oracle, tokenizer) -> None:
    recalls = []
    for ex in load_rag_examples(DATA)[:3]:
        passages = [
            tokenizer.decode(tokenizer(p, add_special_tokens=False)["input_ids"][:160])
            for p in ex.passages[:4]
        ]
        prompt = build_prompt(tokenizer, passages, ex.question)
        ids, layout = prompt.token_ids, prompt.layout
        full = real_oracle.prefill(ids)
        # The first chunk sits at position 0: its independent KV is exact, no drift.
        later = layout.chunks[1:]
        chunks = [
            real_oracle.encode_chunk(
                ids[s.start : s.end], ranker=lambda k, v: cachetune_ranking(k, v, 0.5)
            )
            for s in later
        ]
        drift = chunk_drift(full.kv, chunks, later, layer_freqs(real_oracle.w))
        ranking = torch.cat([c.ranking for c in chunks])
        recalls.append(recall_at(drift, ranking, 0.15))
    random_expectation = 0.15
    assert sum(recalls) / len(recalls) > random_expectation, recalls


def test_recall_at_counts_overlap() -> None:
    truth = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    assert recall_at(truth, truth, 0.2) == 1.0
    assert recall_at(truth, -truth, 0.2) == 0.0
    assert recall_at(truth, torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 0, 0, 4.5]), 0.2) == 0.5
