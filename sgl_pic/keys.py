"""Strong content keys for cached chunk KV.

Reused KV must never come from different tokens, model or settings, so every key
hashes (SHA-256) the exact token ids together with a fingerprint of everything that
shapes the KV bytes: model identity, KV and compute dtypes, quantization, RoPE settings,
page size, the tensor-, pipeline- and attention-parallel shard, whether keys are
stored before or after RoPE, and how the ranking stored beside the KV was made. A disk
tier shared by differently configured servers then never hands one server another's
records.

Long chunks are split into segments of at most ``segment_tokens`` tokens, each keyed
by its parent segment's key plus its own tokens (DARIC 3.3.2), so segment i of a chunk
is only found when segments 0..i-1 match too.

Every key also names the request's isolation namespace (its tenant: SGLang's
``extra_key`` and ``cache_salt``, see ``sgl_pic.core.tenants``), so a chunk one
tenant stored is never found by another, in any tier; requests without either share the
default namespace "".

A chunk encoded after other tokens (``PicConfig.chunk_context``) holds K/V that depend on
them: its key also names a digest of those tokens (``context``), so it is found only
behind the same ones; "" is a chunk encoded alone, whose keys are unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# 2: the fingerprint gained compute dtype, quantization, RoPE, pipeline and attention
# parallel fields; keys of version 1 never match version 2 ones.
# 3: it gained the recipe of the ranking stored with each chunk.
# 4: chunk and segment keys name the isolation namespace; records of version 3 (stored
# before, for every tenant alike) are never served again.
KEY_VERSION = 4


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything besides the tokens that determines a chunk's KV bytes.

    Two servers share cached KV only when every field is equal, so a field belongs here
    as soon as changing it can change one byte of a chunk's K or V (or which layers,
    heads or tokens a rank holds). New fields get defaults that mean "the plain
    single-GPU setting", so fingerprints built by older callers keep their meaning.

    model_id:         a digest of the model's configs and weight contents
                      (``sgl_pic.model_identity``), never just a user-given name.
    dtype:            the KV dtype: the element type of the KV pool the chunk lives in,
                      e.g. "float32", "bfloat16", "float8_e4m3fn" (the name predates
                      the other dtype fields and is kept so callers need not change).
    page_size:        KV page size of the pool the chunk lives in.
    tp_rank:          tensor-parallel rank (each rank holds its own heads).
    tp_size:          tensor-parallel world size.
    pre_rope:         keys stored before RoPE (deferred RoPE) rather than after.
    compute_dtype:    dtype of weights and activations (SGLang's resolved ``--dtype``);
                      "" when unknown. The same KV dtype computed at another precision
                      holds other bytes.
    quantization:     weight/activation quantization method ("" for none): quantized
                      projections produce other K and V.
    kv_cache_dtype:   the server's KV storage recipe (``--kv-cache-dtype``, "auto" when
                      the KV dtype follows the model): two FP4/FP8 recipes can share a
                      storage dtype and still encode differently.
    kv_scales:        SHA-256 of the KV scaling-factor file (``--quantization-param-path``),
                      "" for none: FP8 KV bytes depend on those scales.
    rope:             canonical sorted-key JSON of every RoPE-affecting setting (theta,
                      scaling type and parameters, rotary fraction, head dim, ...), see
                      ``sgl_pic.binding.fingerprint.rope_signature``; "" when unknown.
                      Post-RoPE keys depend on it, and so does re-rotating pre-RoPE keys.
    config_overrides: canonical JSON of model-config overrides applied on top of the
                      checkpoint's config (``--json-model-override-args``), "" for none;
                      ``model_id`` hashes only the config file on disk.
    pp_rank:          pipeline-parallel rank (each rank holds its own layers).
    pp_size:          pipeline-parallel world size.
    attn_layout:      canonical JSON of the attention-parallel shard (attention TP and
                      context-parallel ranks and widths), "" for plain TP: with DP or CP
                      attention, one TP rank holds other heads or tokens.
    ranking:          how the CacheTune ranking stored with every chunk was computed
                      (``sgl_pic.selection.ranking_recipe``), "" for none: a record is its
                      KV and its ranking, and a ranking made with another alpha orders
                      the tokens differently.
    """

    model_id: str
    dtype: str
    page_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pre_rope: bool = False
    compute_dtype: str = ""
    quantization: str = ""
    kv_cache_dtype: str = "auto"
    kv_scales: str = ""
    rope: str = ""
    config_overrides: str = ""
    pp_rank: int = 0
    pp_size: int = 1
    attn_layout: str = ""
    ranking: str = ""

    def digest(self) -> str:
        """SHA-256 over the key version and every field, names included (so two fields
        can never trade values unnoticed)."""
        payload = json.dumps({"v": KEY_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class SegmentKey:
    """Key of one cached segment: ``digest`` names it; ``start``/``end`` locate its
    tokens inside the chunk."""

    digest: str
    start: int
    end: int


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # Fixed-width little-endian encoding: no two token lists share bytes.
    return b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids)


def _root(fingerprint: ModelFingerprint, namespace: str, context: str = "") -> str:
    """Where a namespace's key chains start: the fingerprint's digest for the default
    namespace, else a digest of it and the namespace; a chunk encoded after a context
    starts from a digest of that root and the context's."""
    root = fingerprint.digest()
    if namespace:
        root = _qualified(b"sgl_pic.namespace\0", root, namespace)
    return _qualified(b"sgl_pic.context\0", root, context) if context else root


def _qualified(tag: bytes, root: str, name: str) -> str:
    """A digest of ``root`` and ``name`` under ``tag``; the name is length-prefixed, so no
    two (root, name) pairs share bytes."""
    h = hashlib.sha256()
    h.update(tag)
    h.update(root.encode())
    encoded = name.encode()
    h.update(len(encoded).to_bytes(8, "little") + encoded)
    return h.hexdigest()


def chunk_digest(
    token_ids: Sequence[int], fingerprint: ModelFingerprint, namespace: str = "", context: str = ""
) -> str:
    """SHA-256 key of a whole chunk of ``namespace`` ("" the default one), encoded after
    the tokens ``context`` digests ("" alone)."""
    h = hashlib.sha256()
    h.update(b"sgl_pic.chunk\0")
    h.update(_root(fingerprint, namespace, context).encode())
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(_token_bytes(token_ids))
    return h.hexdigest()


def segment_keys(
    token_ids: Sequence[int],
    fingerprint: ModelFingerprint,
    segment_tokens: int = 256,
    namespace: str = "",
    context: str = "",
) -> tuple[SegmentKey, ...]:
    """Chained keys of the segments of one chunk of ``namespace`` ("" the default one),
    encoded after the tokens ``context`` digests ("" alone), in order; the chain starts
    from the root of both, so no segment key of one namespace or context is a key of
    another."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    if len(token_ids) == 0:
        raise ValueError("a chunk needs at least one token")
    parent = _root(fingerprint, namespace, context)
    keys: list[SegmentKey] = []
    for start in range(0, len(token_ids), segment_tokens):
        seg = token_ids[start : start + segment_tokens]
        h = hashlib.sha256()
        h.update(b"sgl_pic.segment\0")
        h.update(parent.encode())
        h.update(len(seg).to_bytes(8, "little"))
        h.update(_token_bytes(seg))
        parent = h.hexdigest()
        keys.append(SegmentKey(parent, start, start + len(seg)))
    return tuple(keys)
