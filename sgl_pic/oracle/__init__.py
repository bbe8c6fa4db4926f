"""Plain-torch exact reference for chunk reuse (see ``oracle.Oracle``)."""

from sgl_pic.oracle.forward import KVCache
from sgl_pic.oracle.model_weights import LayerWeights
from sgl_pic.oracle.oracle import ChunkKV, FullPrefill, Oracle, ReuseResult
from sgl_pic.oracle.rope_scaling import RopeFrequencies, rope_frequencies
from sgl_pic.oracle.weights import ModelWeights, load_hf_model, weights_from_hf

__all__ = [
    "ChunkKV",
    "FullPrefill",
    "KVCache",
    "LayerWeights",
    "ModelWeights",
    "Oracle",
    "ReuseResult",
    "RopeFrequencies",
    "load_hf_model",
    "rope_frequencies",
    "weights_from_hf",
]
