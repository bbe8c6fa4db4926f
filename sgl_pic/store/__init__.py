"""Chunk KV store: host and disk tiers, a shared tier on a distributed store (Mooncake),
the on-disk format, sparse loading with deferred RoPE, and CacheTune's recompute-ratio
cost model. The per-layer pipeline that loads lower
tiers during the forward is ``sgl_pic.engine.layer_feed.LayerFeed``."""

from sgl_pic.store.base import (
    ChunkKV,
    ChunkStore,
    EvictResult,
    LayerKV,
    StoreStats,
    make_store,
    register_store,
    store_names,
)
from sgl_pic.store.cost_model import (
    CostParams,
    SearchConfig,
    SearchResult,
    balance_ratio,
    choose_ratio,
    golden_section,
    ttft,
)
from sgl_pic.store.deletion import DeleteReport, Deletion, content_digest, segment_contents
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.errors import (
    BadMagicError,
    CorruptRecordError,
    ForeignModelError,
    RecordShapeError,
    StoreError,
    TokenMismatchError,
    TruncatedRecordError,
    UnsupportedFormatError,
)
from sgl_pic.store.host import HostStore, HostStoreConfig, WriteBack, WriteBackConfig
from sgl_pic.store.loader import (
    ChunkPlacement,
    FetchedLayer,
    LoadedLayer,
    LoaderConfig,
    LoadStats,
    SparseLoader,
    complement,
)
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from sgl_pic.store.store_link import LinkConfig
from sgl_pic.store.tiered import DeviceTier, TieredStore, TieredStoreConfig

__all__ = [
    "BadMagicError",
    "ChunkKV",
    "ChunkPlacement",
    "ChunkStore",
    "CorruptRecordError",
    "CostParams",
    "DeleteReport",
    "Deletion",
    "DeviceTier",
    "DiskStore",
    "DiskStoreConfig",
    "EvictResult",
    "FetchedLayer",
    "ForeignModelError",
    "HostStore",
    "HostStoreConfig",
    "LayerKV",
    "LinkConfig",
    "LoadStats",
    "LoadedLayer",
    "LoaderConfig",
    "RecordShapeError",
    "SearchConfig",
    "SearchResult",
    "SharedStore",
    "SharedStoreConfig",
    "SparseLoader",
    "StoreError",
    "StoreStats",
    "TieredStore",
    "TieredStoreConfig",
    "TokenMismatchError",
    "TruncatedRecordError",
    "UnsupportedFormatError",
    "WriteBack",
    "WriteBackConfig",
    "balance_ratio",
    "choose_ratio",
    "complement",
    "content_digest",
    "golden_section",
    "make_store",
    "register_store",
    "segment_contents",
    "store_names",
    "ttft",
]
