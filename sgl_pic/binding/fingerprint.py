"""The chunk-cache fingerprint of a running SGLang server.

Every chunk key hashes a ``ModelFingerprint`` (``sgl_pic.keys``), and the host and disk
tiers refuse records of another fingerprint. So the fingerprint must name everything
that changes a chunk's KV bytes, or which layers, heads and tokens this rank holds; a
disk directory shared by differently configured servers (another dtype, quantization,
RoPE scaling, parallel layout) then never serves one server the other's KV.

Everything is read from the context SGLang hands the radix-cache factory
(``sglang.srt.mem_cache.registry.TreeCacheBuildContext``: ``server_args``, ``params``
(``CacheInitParams``), ``model_config``, ``tp_rank``, ``tp_size``) and, for the
attention-parallel layout the context does not carry, from SGLang's published parallel
state. This module imports SGLang only inside ``attention_layout``'s default path, so
the rest works (and is tested) without a server.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from sgl_pic.file_digests import FileDigests
from sgl_pic.keys import ModelFingerprint
from sgl_pic.model_identity import model_identity

# SGLang's --dtype spellings that name the same dtype as a torch name.
_DTYPE_ALIASES = MappingProxyType({"half": "float16", "float": "float32", "bf16": "bfloat16"})

# Config attributes RoPE reads under an older name: one spelling per setting, so a config
# from transformers 4.x and one from 5.x for the same checkpoint agree.
_ROPE_ALIASES = MappingProxyType(
    {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}
)
# Attributes folded into the per-type parameter dict rather than listed as extras.
_ROPE_FOLDED = frozenset(
    {"rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor", *_ROPE_ALIASES}
)

# Errors SGLang's ParallelContext raises for a value this process never published.
_UNPUBLISHED = (AttributeError, RuntimeError, ValueError)


def server_fingerprint(
    ctx: Any,
    kv_dtype: torch.dtype,
    parallel: Any | None = None,
    *,
    digests: FileDigests | None = None,
) -> ModelFingerprint:
    """The fingerprint of the server building its radix cache from ``ctx``. Raises
    ``model_identity.ModelIdentityError`` when the weights have no identity to key by.

    ctx:       SGLang's ``TreeCacheBuildContext`` (or anything with its attributes).
    kv_dtype:  element dtype of the KV pool (``pool.dtype``), the bytes chunk KV holds.
    parallel:  SGLang's ``ParallelContext``; None reads the process's own
               (``sglang.srt.runtime_context.get_parallel()``). Tests pass a stand-in.
    digests:   where weight-file digests are cached across launches and ranks; None
               hashes every weight file not named by the HF cache.
    """
    args = ctx.server_args
    model_config = ctx.model_config
    pp_rank, pp_size = _pipeline_shard(ctx)
    return ModelFingerprint(
        model_id=model_identity(
            str(args.model_path),
            digests or FileDigests(None),
            revision=getattr(args, "revision", None),
            download_dir=getattr(args, "download_dir", None),
            load_format=str(getattr(args, "load_format", None) or "auto"),
        ),
        dtype=dtype_name(kv_dtype),
        page_size=int(getattr(args, "page_size", None) or 1),
        tp_rank=int(ctx.tp_rank),
        tp_size=int(ctx.tp_size),
        compute_dtype=_compute_dtype(model_config, args),
        # ModelConfig's value is the resolved one: a quantized checkpoint names its
        # method in its config even when --quantization is not given.
        quantization=str(
            getattr(model_config, "quantization", None) or getattr(args, "quantization", None) or ""
        ).lower(),
        kv_cache_dtype=str(getattr(args, "kv_cache_dtype", None) or "auto").lower(),
        kv_scales=_file_digest(getattr(args, "quantization_param_path", None)),
        rope=rope_signature(_text_config(model_config)),
        config_overrides=_overrides(getattr(args, "json_model_override_args", None)),
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_layout=attention_layout(ctx, parallel),
    )


def machine_digests() -> FileDigests:
    """Weight-file digests shared by every process of this machine (the ranks of a server,
    later launches): ``~/.cache/sgl_pic/weight_digests``."""
    from sgl_pic.paths import cache_root

    return FileDigests(cache_root() / "weight_digests")


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> "bfloat16"; SGLang's --dtype aliases map to torch names."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def rope_signature(hf_config: Any) -> str:
    """Canonical sorted-key JSON of every RoPE-affecting setting of a model config.

    Reads transformers 5.x ``rope_parameters`` (also per layer type, as Gemma 3 has it)
    and the older ``rope_scaling`` dict plus top-level ``rope_theta`` /
    ``partial_rotary_factor``, and writes them one way: "type" becomes "rope_type", a
    missing type is "default", a missing rotary fraction is 1.0, None values are
    dropped, numbers are floats. It adds the head dim (the rotary width derives from
    it), ``max_position_embeddings`` when some scaling is not "default" (dynamic NTK,
    YaRN and LongRoPE read it), and every other config attribute whose name mentions
    "rope" or "rotary", so a setting this function does not know still counts.
    """
    attrs = _config_attrs(hf_config)
    for old, new in _ROPE_ALIASES.items():
        if old in attrs and new not in attrs:
            attrs[new] = attrs[old]
    merged: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):  # 5.x's rope_parameters wins
        value = attrs.get(name)
        if isinstance(value, Mapping):
            merged.update(value)
    if merged and all(isinstance(v, Mapping) for v in merged.values()):
        # One parameter set per attention layer type ("full_attention", ...).
        params: Any = {str(k): _rope_params(v, attrs) for k, v in merged.items()}
        kinds = {p["rope_type"] for p in params.values()}
    else:
        params = _rope_params(merged, attrs)
        kinds = {params["rope_type"]}
    signature: dict[str, Any] = {"params": params, "head_dim": _head_dim(attrs)}
    if kinds != {"default"}:
        signature["max_position_embeddings"] = attrs.get("max_position_embeddings")
    extras = {
        k: v
        for k, v in attrs.items()
        if k not in _ROPE_FOLDED and ("rope" in k.lower() or "rotary" in k.lower())
    }
    if extras:
        signature["extra"] = extras
    return json.dumps(_canonical(signature), sort_keys=True, separators=(",", ":"))


def attention_layout(ctx: Any, parallel: Any | None = None) -> str:
    """Canonical JSON of this rank's attention-parallel shard, "" for plain TP.

    With DP attention, one TP rank holds the heads of a narrower attention-TP group;
    with attention context parallelism (CP, DCP) it holds a slice of the tokens. Neither
    is visible in (tp_rank, tp_size), and the factory context carries only the CP
    values, so the attention-TP and DCP ones come from SGLang's ParallelContext.
    """
    if parallel is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    tp_rank, tp_size = int(ctx.tp_rank), int(ctx.tp_size)
    params = ctx.params
    try:
        attn_tp = (int(parallel.attn_tp_rank), int(parallel.attn_tp_size))
        attn_cp = (int(parallel.attn_cp_rank), int(parallel.attn_cp_size))
        dcp_size = int(parallel.attn_dcp_size)
        dcp = (int(parallel.attn_dcp_rank), dcp_size) if dcp_size > 1 else (0, 1)
    except _UNPUBLISHED:
        # No published parallel state (a process that built no SGLang groups). The
        # context still names the CP shard; attention TP equals TP without DP
        # attention (SGLang: attn_tp_size = tp_size // attn_dp_size // attn_cp_size).
        # Anything else would be a guess, and a wrong guess crosses records.
        attn_cp = (int(params.attn_cp_rank), int(params.attn_cp_size))
        args = ctx.server_args
        dp_attention = int(getattr(args, "attn_dp_size", 1) or 1) > 1 or bool(
            getattr(args, "enable_dp_attention", False)
        )
        if dp_attention or int(getattr(args, "dcp_size", 1) or 1) > 1:
            raise RuntimeError(
                "sgl_pic: the attention-parallel layout is not published; cannot "
                "fingerprint a DP-attention or DCP server without it"
            ) from None
        width = tp_size // attn_cp[1]
        attn_tp, dcp = (tp_rank % width, width), (0, 1)
    if attn_tp == (tp_rank, tp_size) and attn_cp == (0, 1) and dcp == (0, 1):
        return ""  # plain TP: (tp_rank, tp_size) already says which heads this rank holds
    layout = {"attn_tp": list(attn_tp), "attn_cp": list(attn_cp), "attn_dcp": list(dcp)}
    return json.dumps(layout, sort_keys=True, separators=(",", ":"))


def _pipeline_shard(ctx: Any) -> tuple[int, int]:
    """(pp_rank, pp_size): SGLang 0.5.23 puts both on the context's CacheInitParams."""
    params = getattr(ctx, "params", None)
    rank, size = getattr(params, "pp_rank", None), getattr(params, "pp_size", None)
    if rank is not None and size is not None:
        return int(rank), int(size)
    # An SGLang without them on the context: rank 0 of 1 is the truth only when the
    # server runs no pipeline parallelism at all.
    size = int(getattr(ctx.server_args, "pp_size", 1) or 1)
    if size != 1:
        raise RuntimeError(f"sgl_pic: pipeline rank unknown with pp_size={size}")
    return 0, 1


def _compute_dtype(model_config: Any, args: Any) -> str:
    dtype = getattr(model_config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype_name(dtype)
    # ModelConfig always resolves --dtype to a torch dtype; the raw flag is the fallback
    # ("auto" still names one dtype per model config, which model_id covers).
    return dtype_name(str(dtype or getattr(args, "dtype", None) or ""))


def _text_config(model_config: Any) -> Any:
    # Multimodal models keep their language model's RoPE settings in the text config.
    return getattr(model_config, "hf_text_config", None) or model_config.hf_config


def _file_digest(path: str | None) -> str:
    """SHA-256 of a file's bytes, "" for no path. An unreadable file is named by its path
    instead: never equal to a digest, so it shares nothing with a readable one."""
    if not path:
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return f"unreadable:{path}"


def _overrides(raw: Any) -> str:
    """Canonical JSON of --json-model-override-args, "" when it overrides nothing."""
    if raw is None or raw == "":
        return ""
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return str(raw)  # SGLang would have refused it; keep it distinct regardless
    if not value:
        return ""
    return json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"))


def _config_attrs(hf_config: Any) -> dict[str, Any]:
    # PretrainedConfig.to_dict() lists every attribute, custom ones included; a plain
    # namespace (tests, remote-code configs without it) has them in vars().
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    return dict(vars(hf_config))


def _rope_params(raw: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """One parameter set in canonical spelling, top-level settings filled in."""
    params = {str(k): v for k, v in raw.items() if v is not None}
    kind = params.pop("type", None)
    params.setdefault("rope_type", kind or "default")
    if "rope_theta" not in params and attrs.get("rope_theta") is not None:
        params["rope_theta"] = attrs["rope_theta"]
    factor = attrs.get("partial_rotary_factor")
    params.setdefault("partial_rotary_factor", 1.0 if factor is None else factor)
    return params


def _head_dim(attrs: Mapping[str, Any]) -> int | None:
    if attrs.get("head_dim"):
        return int(attrs["head_dim"])
    hidden, heads = attrs.get("hidden_size"), attrs.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def _canonical(value: Any) -> Any:
    """JSON-ready value with one spelling per meaning: numbers as floats (8 == 8.0),
    mappings with string keys and no None values, sequences as lists."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return str(value)
