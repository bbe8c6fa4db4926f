"""The server's phase-2 read cap (``PicServerSettings.read_cap``): from SGLang's model
config and the tensor-parallel size alone, so every backend and rank runs the same runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.config import PicConfig
from sgl_pic.engine.kv_reads import ReadCap


def model_config(heads: int, kv_heads: int, head_dim: int) -> SimpleNamespace:
    """SGLang's ModelConfig as the cap reads it: KV heads per rank split, or replicated
    when fewer than the ranks (``get_num_kv_heads``)."""
    return SimpleNamespace(
        num_attention_heads=heads,
        head_dim=head_dim,
        get_num_kv_heads=lambda tp: max(1, kv_heads // tp),
    )


def test_the_cap_follows_the_models_group_per_rank() -> None:
    llama3 = model_config(32, 8, 128)
    default = PicServerSettings(PicConfig())
    assert default.read_cap(llama3, 1) == ReadCap(4, 128, 1.4, 8192)  # on by default
    settings = PicServerSettings(PicConfig(), phase2_read_budget=1.25, phase2_read_min_tokens=0)
    assert settings.read_cap(llama3, 1) == ReadCap(4, 128, 1.25)
    assert settings.read_cap(llama3, 8) == ReadCap(4, 128, 1.25)
    # 16 ranks: 2 query heads and 1 (replicated) KV head each.
    assert settings.read_cap(llama3, 16) == ReadCap(2, 128, 1.25)
    off = PicServerSettings(PicConfig(), phase2_read_budget=0)
    assert off.read_cap(llama3, 1) is None


@pytest.mark.parametrize("bad", [-1, 1001])
def test_a_budget_is_in_range(bad: float) -> None:
    with pytest.raises(ValueError, match=r"phase2_read_budget must be in \[0, 1000\]"):
        PicServerSettings(PicConfig(), phase2_read_budget=bad)


def test_the_floor_is_a_count_of_tokens() -> None:
    with pytest.raises(ValueError, match="phase2_read_min_tokens must be an int >= 0"):
        PicServerSettings(PicConfig(), phase2_read_min_tokens=-1)
