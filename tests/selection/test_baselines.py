import torch

from sgl_pic.config import PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.selection import SelectionContext, finalize, make_policy

# [chunk 0-10][chunk 10-13][fresh 13-20][chunk 20-40][fresh 40-42]
LAYOUT = PromptLayout.from_spans(42, [[0, 10], [10, 13], [20, 40]])


def _select(name: str, layout: PromptLayout = LAYOUT, **overrides: object) -> list[int]:
    policy = make_policy(PicConfig(policy=name, **overrides))
    return policy.select(SelectionContext(layout)).indices.tolist()


def test_full_recompute_selects_every_token() -> None:
    assert _select("full_recompute") == list(range(42))


def test_full_reuse_selects_nothing_but_finalize_adds_fresh_and_last() -> None:
    assert _select("full_reuse") == []
    empty = make_policy(PicConfig(policy="full_reuse")).select(SelectionContext(LAYOUT))
    assert finalize(empty, LAYOUT).indices.tolist() == list(range(13, 20)) + [40, 41]


def test_epic_takes_first_k_of_every_chunk_but_the_first_segment() -> None:
    # The chunk at 10-13 is shorter than k and contributes all of its tokens.
    assert _select("epic", epic_k=4) == [10, 11, 12, 20, 21, 22, 23]


def test_epic_includes_a_leading_chunk_that_follows_fresh_text() -> None:
    layout = PromptLayout.from_spans(20, [[3, 10], [10, 20]])
    assert _select("epic", layout, epic_k=2) == [3, 4, 10, 11]


def test_epic_with_k_zero_selects_nothing() -> None:
    assert _select("epic", epic_k=0) == []


def test_selections_are_int64() -> None:
    for name in ("full_recompute", "full_reuse", "epic"):
        policy = make_policy(PicConfig(policy=name))
        assert policy.select(SelectionContext(LAYOUT)).indices.dtype == torch.int64
