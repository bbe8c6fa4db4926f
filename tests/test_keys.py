from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict

import pytest

from sgl_pic.keys import ModelFingerprint, chunk_digest, segment_keys

FP = ModelFingerprint(model_id="m" * 64, dtype="float32")


# One changed value per field; test_every_field_has_a_change keeps it complete.
CHANGES: dict[str, object] = {
    "model_id": "n" * 64,
    "dtype": "bfloat16",
    "page_size": 16,
    "tp_rank": 1,
    "tp_size": 2,
    "pre_rope": True,
    "compute_dtype": "bfloat16",
    "quantization": "fp8",
    "kv_cache_dtype": "fp8_e4m3",
    "kv_scales": "s" * 64,
    "rope": '{"params":{"rope_type":"yarn"}}',
    "config_overrides": '{"num_hidden_layers":2.0}',
    "pp_rank": 1,
    "pp_size": 2,
    "attn_layout": '{"attn_cp":[0,1],"attn_dcp":[0,1],"attn_tp":[0,1]}',
    "ranking": "cachetune_alpha=0.25",
}


def test_every_field_has_a_change() -> None:
    assert set(CHANGES) == {f.name for f in dataclasses.fields(ModelFingerprint)}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_each_fingerprint_field_changes_the_digest(field: str) -> None:
    other = dataclasses.replace(FP, **{field: CHANGES[field]})
    assert getattr(other, field) != getattr(FP, field)
    assert other.digest() != FP.digest()
    assert chunk_digest([1, 2, 3], other) != chunk_digest([1, 2, 3], FP)
    assert segment_keys([1, 2, 3], other)[0].digest != segment_keys([1, 2, 3], FP)[0].digest


def test_equal_fields_give_equal_digests() -> None:
    a = ModelFingerprint(**CHANGES)  # type: ignore[arg-type]
    b = ModelFingerprint(**dict(CHANGES))  # type: ignore[arg-type]
    assert a is not b and a == b and a.digest() == b.digest()
    assert ModelFingerprint(model_id="m" * 64, dtype="float32").digest() == FP.digest()


def test_defaults_are_the_plain_single_gpu_setting() -> None:
    # Callers that predate the new fields build the same fingerprint as before.
    explicit = ModelFingerprint(
        model_id="m" * 64,
        dtype="float32",
        page_size=1,
        tp_rank=0,
        tp_size=1,
        pre_rope=False,
        compute_dtype="",
        quantization="",
        kv_cache_dtype="auto",
        kv_scales="",
        rope="",
        config_overrides="",
        pp_rank=0,
        pp_size=1,
        attn_layout="",
        ranking="",
    )
    assert explicit == FP
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP.quantization = "fp8"  # type: ignore[misc]


def test_digest_depends_on_tokens() -> None:
    base = chunk_digest([1, 2, 3], FP)
    assert chunk_digest([1, 2, 3], FP) == base
    assert chunk_digest([1, 2, 4], FP) != base
    assert chunk_digest([1, 2], FP) != base


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


def test_keys_name_the_namespace_and_version_3_keys_are_never_found() -> None:
    """Each namespace's chain starts apart, even where one name is a prefix of another;
    and no key of the default namespace equals one made before namespaces existed."""
    toks = list(range(600))
    spaces = ["", "a", "ab", "b"]
    seg = {ns: segment_keys(toks, FP, 256, ns) for ns in spaces}
    whole = {ns: chunk_digest(toks, FP, ns) for ns in spaces}
    assert len({k.digest for ks in seg.values() for k in ks}) == 3 * len(spaces)
    assert len(set(whole.values())) == len(spaces)
    assert segment_keys(toks, FP, 256) == seg[""]

    # The version-3 key of the same chunk (the code before namespaces): never matched.
    payload = json.dumps({"v": 3, **asdict(FP)}, sort_keys=True)
    h = hashlib.sha256(b"sgl_pic.segment\0")
    h.update(hashlib.sha256(payload.encode()).hexdigest().encode())
    h.update((256).to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in toks[:256]))
    assert h.hexdigest() not in {k.digest for ks in seg.values() for k in ks}


def test_keys_name_the_encoding_context_and_alone_keeps_the_old_keys() -> None:
    """A chunk encoded after other tokens is another chunk in every namespace; encoded
    alone ("" context) its keys are the ones made before contexts existed."""
    toks = list(range(300))
    a, b = "a" * 64, "b" * 64
    keys = {
        (ns, ctx): segment_keys(toks, FP, 256, ns, ctx) for ns in ("", "t") for ctx in ("", a, b)
    }
    digests = [k.digest for ks in keys.values() for k in ks]
    assert len(set(digests)) == len(digests) == 2 * len(keys)
    assert keys[("", "")] == segment_keys(toks, FP, 256)
    assert keys[("t", "")] == segment_keys(toks, FP, 256, "t")
    assert len({chunk_digest(toks, FP, ns, ctx) for ns, ctx in keys}) == len(keys)
    assert chunk_digest(toks, FP, "t", "") == chunk_digest(toks, FP, "t")
