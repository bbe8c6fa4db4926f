"""The server fingerprint: read from SGLang's radix-cache factory context, it changes
with every setting that changes KV bytes, and a disk tier shared by two differently
configured servers never crosses their records (nor loses one's to the other's start).

The context here is a stand-in (``SimpleNamespace``) with the attributes of SGLang's
``TreeCacheBuildContext`` that the fingerprint reads, around real transformers configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from sgl_pic.binding.fingerprint import attention_layout, rope_signature, server_fingerprint
from sgl_pic.keys import ModelFingerprint, segment_keys
from sgl_pic.store.base import ChunkKV
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.helpers import same_record

SHAPE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=100,
    max_position_embeddings=131072,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# SGLang's ParallelContext of a plain (no DP/CP attention) single-rank server.
PLAIN = NS(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, attn_dcp_size=1)


def llama(theta: float = 10000.0, scaling: dict[str, Any] | None = None) -> LlamaConfig:
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return LlamaConfig(**SHAPE, rope_parameters=rope)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model")
    (root / "config.json").write_text(json.dumps({"model_type": "llama", **SHAPE}))
    (root / "model.safetensors").write_bytes(b"weights" * 100)
    return root


def make_ctx(model_dir: Path, hf: Any = None, **changes: Any) -> NS:
    """A factory context of a plain single-GPU float32 server; ``changes`` override
    server_args ("args.x"), model_config ("model.x"), params ("params.x") or the context."""
    hf = hf if hf is not None else llama()
    args = NS(
        model_path=str(model_dir),
        page_size=1,
        dtype="auto",
        quantization=None,
        kv_cache_dtype="auto",
        quantization_param_path=None,
        json_model_override_args="{}",
        pp_size=1,
        attn_dp_size=1,
        dcp_size=1,
        enable_dp_attention=False,
    )
    model = NS(hf_config=hf, hf_text_config=hf, dtype=torch.float32, quantization=None)
    params = NS(pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
    ctx = NS(server_args=args, model_config=model, params=params, tp_rank=0, tp_size=1)
    for name, value in changes.items():
        where, _, attr = name.rpartition(".")
        target = {"args": args, "model": model, "params": params, "": ctx}[where]
        setattr(target, attr, value)
    return ctx


def test_plain_server_fingerprint(model_dir: Path) -> None:
    fp = server_fingerprint(make_ctx(model_dir), torch.float32, PLAIN)
    assert (fp.dtype, fp.compute_dtype, fp.quantization, fp.kv_cache_dtype) == (
        "float32",
        "float32",
        "",
        "auto",
    )
    assert (fp.pp_rank, fp.pp_size, fp.tp_rank, fp.tp_size, fp.page_size) == (0, 1, 0, 1, 1)
    assert fp.attn_layout == "" and fp.kv_scales == "" and fp.config_overrides == ""
    assert json.loads(fp.rope)["params"]["rope_theta"] == 10000.0
    assert not fp.pre_rope  # the plugin derives the pre-RoPE one for host/disk tiers
    again = server_fingerprint(make_ctx(model_dir), torch.float32, PLAIN)
    assert again == fp and again.digest() == fp.digest()


def test_every_setting_that_changes_kv_changes_the_digest(model_dir: Path, tmp_path: Path) -> None:
    scales = tmp_path / "kv_scales.json"
    scales.write_text('{"k_scale": 0.5}')
    other_weights = tmp_path / "finetune"
    other_weights.mkdir()
    (other_weights / "config.json").write_text((model_dir / "config.json").read_text())
    (other_weights / "model.safetensors").write_bytes(b"other weights")
    dp_attention = NS(**{**vars(PLAIN), "attn_tp_size": 1, "attn_tp_rank": 0})
    attn_cp = NS(**{**vars(PLAIN), "attn_cp_rank": 1, "attn_cp_size": 2})
    variants: dict[str, tuple[NS, torch.dtype, NS]] = {
        "plain": (make_ctx(model_dir), torch.float32, PLAIN),
        "llama3 scaling": (make_ctx(model_dir, llama(500000.0, LLAMA3)), torch.float32, PLAIN),
        "llama3 factor 4": (
            make_ctx(model_dir, llama(500000.0, {**LLAMA3, "factor": 4.0})),
            torch.float32,
            PLAIN,
        ),
        "yarn scaling": (make_ctx(model_dir, llama(scaling=YARN)), torch.float32, PLAIN),
        "rope theta": (make_ctx(model_dir, llama(theta=20000.0)), torch.float32, PLAIN),
        "quantization": (
            make_ctx(model_dir, **{"model.quantization": "fp8"}),
            torch.float32,
            PLAIN,
        ),
        "compute dtype": (
            make_ctx(model_dir, **{"model.dtype": torch.bfloat16}),
            torch.float32,
            PLAIN,
        ),
        "kv dtype": (make_ctx(model_dir), torch.bfloat16, PLAIN),
        "kv recipe": (
            make_ctx(model_dir, **{"args.kv_cache_dtype": "fp8_e4m3"}),
            torch.float32,
            PLAIN,
        ),
        "kv scales": (
            make_ctx(model_dir, **{"args.quantization_param_path": str(scales)}),
            torch.float32,
            PLAIN,
        ),
        "config override": (
            make_ctx(model_dir, **{"args.json_model_override_args": '{"rms_norm_eps": 1e-5}'}),
            torch.float32,
            PLAIN,
        ),
        "page size": (make_ctx(model_dir, **{"args.page_size": 16}), torch.float32, PLAIN),
        "pp rank 0 of 2": (make_ctx(model_dir, **{"params.pp_size": 2}), torch.float32, PLAIN),
        "pp rank 1 of 2": (
            make_ctx(model_dir, **{"params.pp_rank": 1, "params.pp_size": 2}),
            torch.float32,
            PLAIN,
        ),
        "tp rank 1 of 2": (
            make_ctx(model_dir, tp_rank=1, tp_size=2),
            torch.float32,
            NS(**{**vars(PLAIN), "attn_tp_rank": 1, "attn_tp_size": 2}),
        ),
        # Same TP rank and size, but DP attention: this rank holds all heads.
        "dp attention": (make_ctx(model_dir, tp_rank=1, tp_size=2), torch.float32, dp_attention),
        "attention cp": (make_ctx(model_dir, tp_rank=1, tp_size=2), torch.float32, attn_cp),
        "weights": (make_ctx(other_weights), torch.float32, PLAIN),
    }
    digests = {
        name: server_fingerprint(ctx, kv, parallel).digest()
        for name, (ctx, kv, parallel) in variants.items()
    }
    assert len(set(digests.values())) == len(digests), digests


def test_rope_signature_is_one_spelling_across_transformers_versions() -> None:
    # transformers 4.x kept theta top-level and the scaling dict apart ("type" at first).
    old_default = NS(**SHAPE, rope_theta=10000, rope_scaling=None, head_dim=16)
    assert rope_signature(old_default) == rope_signature(llama())
    old_llama3 = NS(**SHAPE, rope_theta=500000, rope_scaling={**LLAMA3, "type": "llama3"})
    assert rope_signature(old_llama3) == rope_signature(llama(500000.0, LLAMA3))
    old_yarn = NS(**SHAPE, rope_theta=10000.0, rope_scaling={**YARN, "beta_fast": None})
    assert rope_signature(old_yarn) == rope_signature(llama(scaling=YARN))
    # An explicit full rotary fraction is the default one.
    assert rope_signature(NS(**vars(old_default), partial_rotary_factor=1)) == rope_signature(
        old_default
    )


def test_rope_signature_counts_what_it_does_not_know() -> None:
    base = NS(**SHAPE, rope_theta=10000.0)
    sigs = {
        rope_signature(base),
        rope_signature(NS(**vars(base), partial_rotary_factor=0.5)),
        rope_signature(NS(**vars(base), head_dim=32)),
        rope_signature(NS(**vars(base), rope_local_base_freq=10000.0)),
        rope_signature(NS(**vars(base), rotary_dim=8)),
    }
    assert len(sigs) == 5
    # max_position_embeddings matters once scaling reads it, not for plain RoPE.
    longer = {**SHAPE, "max_position_embeddings": 4096}
    assert rope_signature(NS(**longer, rope_theta=10000.0)) == rope_signature(base)
    assert rope_signature(NS(**longer, rope_theta=1e4, rope_scaling=YARN)) != rope_signature(
        NS(**SHAPE, rope_theta=1e4, rope_scaling=YARN)
    )


class Unpublished:
    """SGLang's ParallelContext in a process that never published its parallel state."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"parallel name {name!r} has not been written in this process")


def test_attention_layout_without_published_parallel_state(model_dir: Path) -> None:
    assert attention_layout(make_ctx(model_dir, tp_rank=1, tp_size=2), Unpublished()) == ""
    cp = make_ctx(model_dir, tp_rank=1, tp_size=2, **{"params.attn_cp_rank": 1})
    cp.params.attn_cp_size = 2
    assert json.loads(attention_layout(cp, Unpublished()))["attn_cp"] == [1, 2]
    # A DP-attention or DCP server cannot be told apart without it: refuse, never guess.
    for change in (
        {"args.attn_dp_size": 2},
        {"args.enable_dp_attention": True},
        {"args.dcp_size": 2},
    ):
        with pytest.raises(RuntimeError, match="attention-parallel layout"):
            attention_layout(make_ctx(model_dir, **change), Unpublished())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang")
def test_default_parallel_state_is_sglangs(model_dir: Path) -> None:
    # This test process publishes no parallel state, so SGLang's own context answers
    # like the stand-in: plain TP.
    fp = server_fingerprint(make_ctx(model_dir), torch.float32)
    assert fp == server_fingerprint(make_ctx(model_dir), torch.float32, PLAIN)


def test_pipeline_rank_falls_back_only_without_pipeline_parallelism(model_dir: Path) -> None:
    ctx = make_ctx(model_dir)
    ctx.params = NS(attn_cp_rank=0, attn_cp_size=1)  # an SGLang without pp fields here
    fp = server_fingerprint(ctx, torch.float32, PLAIN)
    assert (fp.pp_rank, fp.pp_size) == (0, 1)
    ctx.server_args.pp_size = 2
    with pytest.raises(RuntimeError, match="pipeline rank unknown"):
        server_fingerprint(ctx, torch.float32, PLAIN)


# --- a disk tier shared by two differently configured servers ---------------------------

BASE = ModelFingerprint(
    model_id="a" * 64,
    dtype="float32",
    pre_rope=True,
    compute_dtype="float32",
    rope=rope_signature(llama()),
)
TOKENS = list(range(1000, 1040))


def changed(fp: ModelFingerprint, field: str) -> ModelFingerprint:
    """``fp`` with one field set to another value of its type."""
    value = getattr(fp, field)
    if isinstance(value, bool):
        new: Any = not value
    elif isinstance(value, int):
        new = value + 1
    else:
        new = value + "-other"
    return dataclasses.replace(fp, **{field: new})


def record_for(fp: ModelFingerprint, seed: int) -> ChunkKV:
    """The record a server with ``fp`` writes for TOKENS (its own key, its own KV)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, len(TOKENS), 2, 8)
    return ChunkKV(
        key=segment_keys(TOKENS, fp)[0].digest,
        model_digest=fp.digest(),
        token_ids=TOKENS,
        k=torch.randn(shape, generator=g),
        v=torch.randn(shape, generator=g),
        ranking=torch.rand(len(TOKENS), generator=g),
    )


def server_store(root: Path, fp: ModelFingerprint, disk_bytes: int = 1 << 24) -> TieredStore:
    host = HostStoreConfig(capacity_bytes=1 << 20, write_back="on_put")
    disk = DiskStoreConfig(root=str(root), capacity_bytes=disk_bytes)
    return TieredStore(TieredStoreConfig(host, disk), fp.digest())


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelFingerprint)])
def test_shared_disk_never_crosses_records(tmp_path: Path, field: str) -> None:
    fa, fb = BASE, changed(BASE, field)
    rec_a, rec_b = record_for(fa, seed=1), record_for(fb, seed=2)
    assert rec_a.key != rec_b.key and rec_a.model_digest != rec_b.model_digest

    a = server_store(tmp_path, fa)
    assert a.put(rec_a)
    a.flush()
    a_file = a.disk.path_of(rec_a.key)
    a_bytes = a_file.read_bytes()
    a.close()

    # B starts on the same directory: its scan skips A's file and keeps it.
    b = server_store(tmp_path, fb)
    assert b.disk.stats().errors.get("foreign_model") == 1
    assert b.locate(rec_b.key) is None and b.get(rec_b.key, TOKENS) is None
    # Even asked for A's very key, B never serves A's record.
    assert b.locate(rec_a.key) is None
    assert b.get(rec_a.key, TOKENS) is None
    assert b.get_layers(rec_a.key, range(0, 1)) is None
    assert b.peek_ranking(rec_a.key) is None
    assert not b.put(rec_a)  # a record of another fingerprint is refused, not written
    # B writes its own record of the same tokens, then frees all it holds on disk.
    assert b.put(rec_b)
    b.flush()
    assert b.disk.contains(rec_b.key)
    b.disk.evict(1 << 30)
    assert not b.disk.contains(rec_b.key)
    b.close()
    assert a_file.read_bytes() == a_bytes

    # A restarted still has its record, bit for bit, and never B's.
    a = server_store(tmp_path, fa)
    got = a.get(rec_a.key, TOKENS)
    assert got is not None and same_record(got, rec_a)
    assert a.get(rec_b.key, TOKENS) is None
    a.close()


def test_foreign_server_under_pressure_evicts_only_its_own_files(tmp_path: Path) -> None:
    # B's disk tier has room for one record and evicts on every further write; A's file
    # is not B's to count or to delete.
    fa, fb = BASE, changed(BASE, "rope")
    a = server_store(tmp_path, fa)
    rec_a = record_for(fa, seed=1)
    a.put(rec_a)
    a.flush()
    one_file = a.disk.stats().bytes_used
    a.close()
    b = server_store(tmp_path, fb, disk_bytes=one_file + one_file // 2)
    for seed in range(3):
        b.put(dataclasses.replace(record_for(fb, seed=seed), key=f"{seed + 1:064x}"))
        b.flush()
    assert b.disk.stats().evictions == 2 and b.disk.stats().entries == 1
    b.close()
    a = server_store(tmp_path, fa)
    got = a.get(rec_a.key, TOKENS)
    assert got is not None and same_record(got, rec_a)
    a.close()
