"""``ModelWeights``' per-layer settings: defaults for the Llama family, and the checks that
keep a malformed one from reaching the forward."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sgl_pic.oracle import Oracle
from sgl_pic.oracle.rope_scaling import RopeFrequencies, rope_frequencies


def test_llama_family_shares_one_table_and_attends_fully(tiny_oracle: Oracle) -> None:
    w = tiny_oracle.w
    for li in range(w.num_layers):
        rope = w.rope(li)
        assert rope.inv_freq is w.inv_freq and rope.attention_scaling == w.rope_scale
        assert w.window(li) is None
    assert (w.embed_scale, w.attn_scale, w.unit_offset_norms) == (None, None, False)
    assert w.layers[0].attn_out_norm is None and w.layers[0].mlp_out_norm is None


def test_malformed_per_layer_settings_are_rejected(tiny_oracle: Oracle) -> None:
    w = tiny_oracle.w
    table = w.rope(0)
    with pytest.raises(ValueError, match="RoPE table is needed"):
        dataclasses.replace(w, inv_freq=None)
    with pytest.raises(ValueError, match="RoPE tables for"):
        dataclasses.replace(w, inv_freq=None, layer_rope=(table,))
    with pytest.raises(ValueError, match="windows for"):
        dataclasses.replace(w, windows=(4,))
    with pytest.raises(ValueError, match=">= 1"):
        dataclasses.replace(w, windows=(0,) * w.num_layers)


def test_layer_tables_take_precedence(tiny_oracle: Oracle) -> None:
    w = tiny_oracle.w
    other = RopeFrequencies(w.inv_freq / 2, 1.0, w.head_dim)
    tables = (w.rope(0), other) + (w.rope(0),) * (w.num_layers - 2)
    mixed = dataclasses.replace(w, inv_freq=None, layer_rope=tables)
    assert torch.equal(mixed.rope(1).inv_freq, w.inv_freq / 2)
    assert torch.equal(mixed.rope(0).inv_freq, w.inv_freq)


def test_rope_of_a_layer_type_the_config_lacks_is_an_error() -> None:
    cfg = SimpleNamespace(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        head_dim=16,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    assert rope_frequencies(cfg, "full_attention").inv_freq.numel() == 8
    with pytest.raises(ValueError, match="sliding_attention"):
        rope_frequencies(cfg, "sliding_attention")
