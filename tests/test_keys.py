from __future__ import annotations

import dataclasses

import pytest

from sgl_pic.keys import ModelFingerprint, chunk_digest, segment_keys

FP = ModelFingerprint(model_id="m" * 64, dtype="float32")


def test_digest_depends_on_tokens_and_every_fingerprint_field() -> None:
    base = chunk_digest([1, 2, 3], FP)
    assert chunk_digest([1, 2, 3], FP) == base
    assert chunk_digest([1, 2, 4], FP) != base
    assert chunk_digest([1, 2], FP) != base
    changes = {
        "model_id": "n" * 64,
        "dtype": "bfloat16",
        "page_size": 16,
        "tp_rank": 1,
        "tp_size": 2,
        "pre_rope": True,
    }
    for field, value in changes.items():
        other = dataclasses.replace(FP, **{field: value})
        assert chunk_digest([1, 2, 3], other) != base, field


def test_token_encoding_has_no_collisions_across_boundaries() -> None:
    # 256 as one token must not read as tokens [0, 1] or similar byte splits.
    assert chunk_digest([256], FP) != chunk_digest([0, 1], FP)
    assert chunk_digest([1, 0], FP) != chunk_digest([256], FP)


def test_segments_are_chained_and_bounded() -> None:
    tokens = list(range(600))
    keys = segment_keys(tokens, FP, segment_tokens=256)
    assert [(k.start, k.end) for k in keys] == [(0, 256), (256, 512), (512, 600)]
    # The same tokens as a second segment after a different first segment differ.
    other = segment_keys([9] * 256 + tokens[256:512], FP, segment_tokens=256)
    assert other[1].digest != keys[1].digest
    assert len({k.digest for k in keys}) == 3


def test_bad_segment_arguments() -> None:
    with pytest.raises(ValueError):
        segment_keys([], FP)
    with pytest.raises(ValueError):
        segment_keys([1], FP, segment_tokens=0)
