"""The fidelity measures beyond the first token and the precision floor: ROUGE-L on known
pairs, stop tokens, teacher forcing (exact against exact is zero; the extend equals a
prefill of prompt and answer), the model in a lower dtype, and the bootstrap interval."""

from __future__ import annotations

import copy

import pytest
import torch

from sgl_pic.fidelity import (
    bootstrap_ci,
    first_token_kl,
    oracle_in_dtype,
    paired_ratio_ci,
    position_fidelity,
    rouge_l,
    teacher_forced_logits,
    until_stop,
)
from sgl_pic.oracle import Oracle, weights_from_hf


@pytest.mark.parametrize(
    ("ref", "test", "expected"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], 1.0),
        ([1, 2, 3, 4], [1, 3, 4, 5], 0.75),  # LCS 1 3 4: P = R = 3/4
        ([1, 2, 3], [3, 2, 1], 1 / 3),  # LCS of length 1
        ([1, 2, 3, 4, 5, 6], [2, 4], 0.5),  # P = 1, R = 1/3
        ([2, 4], [1, 2, 3, 4, 5, 6], 0.5),  # symmetric at beta = 1
        ([1, 2], [3, 4], 0.0),
        ([], [], 1.0),
        ([1], [], 0.0),
    ],
)
def test_rouge_l_on_known_pairs(ref: list[int], test: list[int], expected: float) -> None:
    assert rouge_l(ref, test) == pytest.approx(expected)


def test_until_stop_cuts_at_the_first_stop_token() -> None:
    tokens = torch.tensor([5, 6, 2, 7, 2])
    assert until_stop(tokens, {2}).tolist() == [5, 6]
    assert until_stop(tokens, {2}, keep_stop=True).tolist() == [5, 6, 2]
    assert until_stop(tokens, {9}).tolist() == [5, 6, 2, 7, 2]


def _prompt(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def test_teacher_forcing_exact_against_exact_is_zero(tiny_oracle: Oracle) -> None:
    ids = _prompt()
    full = tiny_oracle.prefill(ids)
    answer = tiny_oracle.generate(full.kv, full.logits, 12)
    a = teacher_forced_logits(tiny_oracle, full.kv, full.logits, answer)
    b = teacher_forced_logits(tiny_oracle, full.kv, full.logits, answer)
    tf = position_fidelity(a, b)
    assert tf == (0.0, 1.0, 12)
    # Along its own greedy answer the model's argmax is that answer, position by position.
    assert torch.equal(a.argmax(-1), answer)


def test_teacher_forced_extend_equals_prefill_of_prompt_and_answer(tiny_oracle: Oracle) -> None:
    ids = _prompt()
    full = tiny_oracle.prefill(ids)
    answer = torch.tensor([3, 50, 7, 7, 90])  # any tokens, not only the greedy ones
    forced = teacher_forced_logits(tiny_oracle, full.kv, full.logits, answer)
    assert forced.shape == (5, 97)
    for t in range(1, 5):
        ref = tiny_oracle.prefill(torch.cat([ids, answer[:t]])).logits
        torch.testing.assert_close(forced[t], ref, atol=1e-4, rtol=1e-4)
    assert full.kv.num_tokens == ids.numel()  # the prompt's KV is not extended in place


def test_teacher_forcing_sees_a_reused_prompts_drift(tiny_oracle: Oracle) -> None:
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout, Span
    from sgl_pic.selection import make_policy

    ids = _prompt(40)
    layout = PromptLayout(40, (Span(0, 12), Span(12, 30)))
    chunks = [tiny_oracle.encode_chunk(ids[s.start : s.end]) for s in layout.chunks]
    full = tiny_oracle.prefill(ids)
    reused = tiny_oracle.reuse(ids, layout, chunks, make_policy(PicConfig(policy="full_reuse")))
    answer = tiny_oracle.generate(full.kv, full.logits, 8)
    ref = teacher_forced_logits(tiny_oracle, full.kv, full.logits, answer)
    test = teacher_forced_logits(tiny_oracle, reused.kv, reused.logits, answer)
    tf = position_fidelity(ref, test)
    assert tf.kl > 1e-6 and tf.positions == 8
    per_position = [first_token_kl(ref[t], test[t]) for t in range(8)]
    assert tf.kl == pytest.approx(sum(per_position) / 8)
    assert per_position[0] == pytest.approx(first_token_kl(full.logits, reused.logits))


def test_position_fidelity_rejects_mismatched_logits() -> None:
    with pytest.raises(ValueError):
        position_fidelity(torch.zeros(3, 5), torch.zeros(4, 5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lower_dtype_floor_is_above_zero(
    tiny_model: torch.nn.Module, tiny_oracle: Oracle, dtype: torch.dtype
) -> None:
    ids = _prompt()
    low = oracle_in_dtype(tiny_oracle, dtype)
    assert low.kv_dtype == dtype and low.w.embed.dtype == dtype
    assert tiny_oracle.w.embed.dtype == torch.float32  # the float32 oracle is untouched
    ref, test = tiny_oracle.prefill(ids), low.prefill(ids)
    assert test.kv.k.dtype == dtype
    kl = first_token_kl(ref.logits, test.logits)
    assert 0 < kl < 0.1  # drift, not a broken model
    # The same as the model's weights loaded in that dtype, as a GPU server loads them
    # (its RoPE frequencies stay float32, as loading in a dtype leaves them).
    model = copy.deepcopy(tiny_model)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    loaded = Oracle(weights_from_hf(model), kv_dtype=dtype)
    assert torch.equal(loaded.prefill(ids).logits, test.logits)


def test_bootstrap_ci() -> None:
    assert bootstrap_ci([0.5] * 7) == [0.5, 0.5]
    values = [float(i) for i in range(20)]
    lo, hi = bootstrap_ci(values)
    assert lo < sum(values) / 20 < hi
    assert hi - lo < 19
    assert bootstrap_ci(values) == [lo, hi]  # seeded: the same interval every run
    assert bootstrap_ci(values, seed=1) != [lo, hi]
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_paired_ratio_ci_resamples_examples_in_pairs() -> None:
    num = [0.1 * (i % 5 + 1) for i in range(40)]
    den = [2 * x for x in num]
    assert paired_ratio_ci(num, den) == pytest.approx([0.5, 0.5])  # paired: exact
    lo, hi = paired_ratio_ci(num, list(reversed(den)))
    assert lo < 0.5 < hi
    assert paired_ratio_ci(num, den[::-1], seed=1) != [lo, hi]
    with pytest.raises(ValueError):
        paired_ratio_ci(num, den[:3])
