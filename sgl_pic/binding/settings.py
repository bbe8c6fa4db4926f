"""Server-wide sgl_pic settings, carried from the launcher to SGLang's scheduler processes.

SGLang spawns its scheduler as a fresh process; the one channel that reaches it without
touching SGLang's argument parser is the environment, so the settings travel as JSON there.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from sgl_pic.config import PicConfig
from sgl_pic.engine.layer_feed import FEED_MODES
from sgl_pic.engine.tenants import TenantPolicy, parse_names
from sgl_pic.http.chat_chunks import parse_roles
from sgl_pic.store.admission import check_mode
from sgl_pic.store.eviction import check_policy

ENV_VAR = "SGLPIC_SETTINGS"  # not SGL_*: SGLang claims that prefix
BACKEND_NAME = "sgl_pic"


@dataclass(frozen=True)
class PicServerSettings:
    """config:             default PicConfig of every request (requests may override fields).
    model_path:           model directory (its fingerprint keys every tier).
    device_cache_fraction: share of SGLang's KV pool chunk nodes may hold, in [0, 1].
    host_cache_mb:        host-memory tier capacity, MiB (0 turns the tier off).
    disk_cache_dir:       disk tier directory ("" turns the tier off); chunks written there
                          survive restarts.
    disk_cache_mb:        disk tier capacity, MiB.
    calibrate:            measure load and compute costs at start-up and pick CacheTune's r
                          per tier (stored as calibration.json beside the disk tier).
    feed_mode:            how host/disk KV is loaded during phase 2: "threaded" or "inorder".
    feed_timeout_s:       longest wait for one layer of host/disk KV; a stuck feed makes
                          its batch run as exact prefill.
    merge_gap:            phase-2 runs of recomputed tokens separated by at most this many
                          tokens run as one sub-request (the gap is recomputed too, which
                          only brings the result closer to exact); 0 keeps runs as selected.
    max_body_mb:          largest HTTP request body accepted (413 above it).
    max_json_depth:       deepest JSON nesting accepted in a request body (400 above it).
    shared_store:         URL of a chunk store shared by several servers (e.g.
                          ``mooncake://HOST:PORT``, see ``sgl_pic.store.object_backend``);
                          "" turns the shared tier off.
    auto_chunk:           roles whose messages /v1/chat/completions marks as chunks
                          itself, a comma list of ``chat_chunks.AUTO_CHUNK_ROLES`` (tool
                          results, documents, earlier turns by role); "" turns it off
                          (requests may still ask with ``"pic": {"auto_chunk": ...}``).
    public_namespaces:    comma list of namespace names (a ``cache_salt`` or ``extra_key``
                          value) whose chunks requests asking for the public scope may read
                          (``tenants.TenantPolicy``); "" (default): tenants share nothing.
    namespace_device_fraction: share of the chunk nodes' slots one isolation namespace
                          (tenant) may hold, in [0, 1]; 0 (default): no cap. Past it a
                          tenant's inserts evict only its own nodes (``ChunkNodeTable``).
    namespace_host_mb:    host-tier MiB one namespace may hold; 0 (default): no cap.
    namespace_disk_mb:    disk-tier MiB one namespace may hold; 0 (default): no cap.
    namespace_metrics:    most namespaces given a label of their own in the per-namespace
                          metrics (the rest share "other"); 0 (default): no per-namespace
                          metrics (``metrics.NamespaceLabels``).
    eviction:             eviction order of chunk nodes, host and disk tiers: "gdsf"
                          (recency, hits and size: a stream of novel chunks does not push
                          out the ones in steady use), "lru" or "lfu"
                          (``sgl_pic.store.eviction``).
    admission:            whether a chunk found in no tier is stored on first sight:
                          "always", "second_sight" (computed in context, stored when seen
                          again), or "adaptive" (second sight while few first-seen chunks
                          come back, as in a stream of novel documents;
                          ``sgl_pic.store.admission``).
    refused:              why chunk reuse is refused for this launch (a model that failed
                          ``--pic-check``); every request then runs as exact prefill. ''
                          when reuse is allowed.
    secret:               per-launch key that signs the chunk marks our HTTP translation
                          makes; the scheduler honours only marks it signed. Empty (SGLang's
                          own launcher) means no marks are honoured: reuse stays off.
    """

    config: PicConfig
    model_path: str = ""
    device_cache_fraction: float = 0.5
    host_cache_mb: int = 2048
    disk_cache_dir: str = ""
    disk_cache_mb: int = 8192
    calibrate: bool = False
    feed_mode: str = "threaded"
    feed_timeout_s: float = 30.0
    merge_gap: int = 0
    max_body_mb: int = 64
    max_json_depth: int = 64
    shared_store: str = ""
    auto_chunk: str = ""
    public_namespaces: str = ""
    namespace_device_fraction: float = 0.0
    namespace_host_mb: int = 0
    namespace_disk_mb: int = 0
    namespace_metrics: int = 0
    eviction: str = "gdsf"
    admission: str = "adaptive"
    refused: str = ""
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.device_cache_fraction <= 1.0:
            raise ValueError(
                f"device_cache_fraction must be in [0, 1], got {self.device_cache_fraction}"
            )
        if self.host_cache_mb < 0 or self.disk_cache_mb < 0:
            raise ValueError("host_cache_mb and disk_cache_mb must be >= 0")
        check_policy(self.eviction)
        check_mode(self.admission)
        if self.feed_mode not in FEED_MODES:
            raise ValueError(
                f"unknown feed_mode {self.feed_mode!r}; valid: {', '.join(FEED_MODES)}"
            )
        if not 0.0 < self.feed_timeout_s <= 3600.0:
            raise ValueError(f"feed_timeout_s must be in (0, 3600], got {self.feed_timeout_s}")
        if isinstance(self.merge_gap, bool) or not 0 <= self.merge_gap <= 4096:
            raise ValueError(f"merge_gap must be an int in [0, 4096], got {self.merge_gap!r}")
        if self.max_body_mb < 1 or self.max_json_depth < 4:
            raise ValueError("max_body_mb must be >= 1 and max_json_depth >= 4")
        if self.shared_store:
            from sgl_pic.store.object_backend import StoreAddress

            StoreAddress.parse(self.shared_store)  # ValueError naming what is wrong
        if not isinstance(self.auto_chunk, str):
            raise ValueError(f"auto_chunk must be a comma list of roles, got {self.auto_chunk!r}")
        parse_roles(self.auto_chunk)  # ValueError naming the unknown role
        if not isinstance(self.public_namespaces, str):
            raise ValueError(
                f"public_namespaces must be a comma list of names, got {self.public_namespaces!r}"
            )
        TenantPolicy.from_names(parse_names(self.public_namespaces))  # ValueError: blank name
        if not 0.0 <= self.namespace_device_fraction <= 1.0:
            raise ValueError(
                f"namespace_device_fraction must be in [0, 1], got {self.namespace_device_fraction}"
            )
        for name in ("namespace_host_mb", "namespace_disk_mb", "namespace_metrics"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.calibrate and not (self.host_cache_mb or self.disk_cache_dir):
            raise ValueError("calibration picks r per host/disk tier: enable one of them")

    @property
    def auto_chunk_roles(self) -> frozenset[str]:
        return parse_roles(self.auto_chunk)

    def namespace_max_tokens(self, capacity_tokens: int) -> int:
        """Chunk-node slots one namespace may hold out of ``capacity_tokens`` (0: no
        cap; a cap never rounds down to none)."""
        if not self.namespace_device_fraction:
            return 0
        return max(1, int(self.namespace_device_fraction * capacity_tokens))

    @property
    def has_lower_tiers(self) -> bool:
        return self.host_cache_mb > 0 or bool(self.disk_cache_dir) or bool(self.shared_store)

    def to_env(self) -> None:
        data = asdict(self)
        data["config"] = asdict(self.config)
        os.environ[ENV_VAR] = json.dumps(data)

    @classmethod
    def from_env(cls) -> PicServerSettings:
        raw = os.environ.get(ENV_VAR)
        if raw is None:
            # Registered through the entry point without our launcher: library defaults.
            return cls(PicConfig())
        data = json.loads(raw)
        data["config"] = PicConfig(**data["config"])
        return cls(**data)
