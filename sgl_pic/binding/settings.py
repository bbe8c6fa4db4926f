"""Server-wide sgl_pic settings, carried from the launcher to SGLang's scheduler processes.

SGLang spawns its scheduler as a fresh process; the one channel that reaches it without
touching SGLang's argument parser is the environment, so the settings travel as JSON there.
Each setting is declared once, on its field (``sgl_pic.declare``); the launcher's flags and
the README's flags table are produced from ``SERVER_SETTINGS`` (``sgl_pic.cli.flags``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sgl_pic.config import PicConfig
from sgl_pic.core.tenants import TenantPolicy, parse_names
from sgl_pic.declare import (
    Check,
    Override,
    Setting,
    by_value,
    check_declared,
    declared,
    in_range,
    int_in,
    setting,
)
from sgl_pic.engine.kv_reads import ReadCap, read_cap
from sgl_pic.engine.layer_feed import FEED_MODES
from sgl_pic.http.chat_chunks import AUTO_CHUNK_ROLES, parse_roles
from sgl_pic.store.admission import ADMISSION_MODES, check_mode
from sgl_pic.store.eviction import EVICTION_POLICIES, check_policy

ENV_VAR = "SGLPIC_SETTINGS"  # not SGL_*: SGLang claims that prefix
BACKEND_NAME = "sgl_pic"


def _tier_mb(_name: str, value: int) -> None:
    if value < 0:
        raise ValueError("host_cache_mb and disk_cache_mb must be >= 0")


def _request_limit(name: str, value: int) -> None:
    if value < {"max_body_mb": 1, "max_json_depth": 4}[name]:
        raise ValueError("max_body_mb must be >= 1 and max_json_depth >= 4")


def _store_url(_name: str, value: str) -> None:
    if value:
        from sgl_pic.store.object_backend import StoreAddress

        StoreAddress.parse(value)  # ValueError naming what is wrong


def _comma_list(what: str, parse: Callable[[str], object]) -> Check:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a comma list of {what}, got {value!r}")
        parse(value)  # ValueError naming the bad entry

    return check


def _default_disk_dir() -> str:
    from sgl_pic.paths import cache_root

    return str(cache_root() / "chunks")


@dataclass(frozen=True)
class PicServerSettings:
    """Server-wide settings: ``config`` is every request's default ``PicConfig`` (requests
    may override some of its fields); each other field is declared once below
    (``sgl_pic.declare``): what it sets, its flag, its check, whether a request may
    override it. Fields without a flag are set by the launcher itself."""

    config: PicConfig
    model_path: str = setting("", "--model-path as given: a directory, GGUF file or hub id")
    device_cache_fraction: float = setting(
        0.5,
        "share of SGLang's KV pool chunk nodes may hold, in [0, 1]",
        flag="--pic-device-cache-fraction",
        check=in_range(0, 1),
    )
    host_cache_mb: int = setting(
        2048, "host-memory tier, MiB (0: off)", flag="--pic-host-cache-mb", check=_tier_mb
    )
    disk_cache_dir: str = setting(
        "",
        "disk tier directory; chunks written there survive restarts ('': off)",
        flag="--pic-disk-cache-dir",
        launch_default=_default_disk_dir,
        shown_default="~/.cache/sgl_pic/chunks",
    )
    disk_cache_mb: int = setting(8192, "disk tier, MiB", flag="--pic-disk-cache-mb", check=_tier_mb)
    calibrate: bool = setting(
        False,
        "measure load and compute costs at start-up on the KV pool's device and pick "
        "CacheTune's r per tier, stored as calibration.json beside the disk tier (with tensor "
        "parallelism every rank takes rank 0's)",
        flag="--pic-calibrate",
    )
    feed_mode: str = setting(
        "threaded",
        "how host/disk KV is loaded during phase 2: by a worker thread, or in order",
        flag="--pic-feed-mode",
        choices=FEED_MODES,
    )
    feed_timeout_s: float = setting(
        30.0,
        "longest wait for one layer of host/disk KV; past it the batch runs as exact prefill",
        flag="--pic-feed-timeout-s",
        check=in_range(0, 3600, low_open=True),
    )
    merge_gap: int = setting(
        0,
        "phase-2 runs of recomputed tokens separated by at most this many tokens run as one "
        "sub-request (the gap is recomputed too, which only brings the result closer to "
        "exact)",
        flag="--pic-merge-gap",
        check=int_in(0, 4096),
    )
    phase2_read_budget: float = setting(
        1.4,
        "a request of at least --pic-phase2-read-min-tokens tokens has its phase-2 runs "
        "merged across their smallest gaps until they read at most this many times the KV "
        "its exact prefill reads, counted with the query tiles of paged GPU backends (the "
        "gaps are recomputed too; the same runs on every backend; below 1 it merges them "
        "into one); 0: no cap",
        flag="--pic-phase2-read-budget",
        metavar="X",
        check=in_range(0, 1000),
    )
    phase2_read_min_tokens: int = setting(
        8192,
        "shortest request the phase-2 read cap binds: below it a layer's prefix KV is small "
        "enough that re-reading it per run costs less than recomputing the merged gaps",
        flag="--pic-phase2-read-min-tokens",
        metavar="N",
        check=int_in(0),
    )
    max_body_mb: int = setting(
        64,
        "largest HTTP request body accepted, MiB (413 above it)",
        flag="--pic-max-body-mb",
        check=_request_limit,
    )
    max_json_depth: int = setting(
        64,
        "deepest JSON nesting accepted in a request body (400 above it)",
        flag="--pic-max-json-depth",
        check=_request_limit,
    )
    shared_store: str = setting(
        "",
        "chunk tier shared by several servers, e.g. ``mooncake://HOST:PORT`` (started by "
        "scripts/shared_store.sh; ``sgl_pic.store.object_backend``); '': off",
        flag="--pic-shared-store",
        metavar="URL",
        check=_store_url,
    )
    auto_chunk: str = setting(
        "",
        "chat messages /v1/chat/completions marks as chunks itself: a comma list of "
        f"{', '.join(AUTO_CHUNK_ROLES)} (tool results, messages named 'document', earlier "
        "turns of the other roles); '': off",
        flag="--pic-auto-chunk",
        metavar="ROLES",
        check=_comma_list("roles", parse_roles),
        override=Override.CHAT,
    )
    public_namespaces: str = setting(
        "",
        "namespaces (a cache_salt or extra_key value, comma list) whose chunks a request "
        'asking for the public scope (``"pic": {"config": {"public_scope": true}}``) may '
        "read; '': tenants share nothing",
        flag="--pic-public-namespaces",
        metavar="NAMES",
        check=_comma_list("names", lambda v: TenantPolicy.from_names(parse_names(v))),
    )
    namespace_device_fraction: float = setting(
        0.0,
        "share of the chunk nodes' pool slots one tenant (cache_salt/extra_key namespace) may "
        "hold, in [0, 1]; past it its inserts evict only its own nodes (0: no cap)",
        flag="--pic-namespace-device-fraction",
        metavar="F",
        check=in_range(0, 1),
    )
    namespace_host_mb: int = setting(
        0,
        "host-tier MiB one tenant may hold (0: no cap)",
        flag="--pic-namespace-host-mb",
        metavar="MIB",
        check=int_in(0),
    )
    namespace_disk_mb: int = setting(
        0,
        "disk-tier MiB one tenant may hold (0: no cap)",
        flag="--pic-namespace-disk-mb",
        metavar="MIB",
        check=int_in(0),
    )
    namespace_metrics: int = setting(
        0,
        "per-tenant metrics for at most N tenants, labelled by a digest prefix, the rest "
        "'other' (``metrics.NamespaceLabels``); 0: off",
        flag="--pic-namespace-metrics",
        metavar="N",
        check=int_in(0),
    )
    eviction: str = setting(
        "gdsf",
        "eviction order of chunk nodes, host and disk tiers: gdsf (recency, hits and size: a "
        "stream of novel chunks does not push out the ones in steady use), lru or lfu",
        flag="--pic-eviction",
        choices=EVICTION_POLICIES,
        check=by_value(check_policy),
    )
    admission: str = setting(
        "adaptive",
        "store a chunk found in no tier on first sight (always), on second sight "
        "(second_sight: computed in context first), or on second sight while few first-seen "
        "chunks come back (adaptive)",
        flag="--pic-admission",
        choices=ADMISSION_MODES,
        check=by_value(check_mode),
    )
    refused: str = setting(
        "",
        "why chunk reuse is refused for this launch (a model that failed --pic-check): every "
        "request then runs as exact prefill; '' when reuse is allowed",
    )
    secret: str = setting(
        "",
        "per-launch key that signs the chunk marks our HTTP translation makes; the scheduler "
        "honours only marks it signed ('', as under SGLang's own launcher: none are)",
        repr=False,
    )

    def __post_init__(self) -> None:
        check_declared(self, SERVER_SETTINGS)
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

    def read_cap(self, model_config: Any, tp_size: int) -> ReadCap | None:
        """Phase 2's read cap for SGLang's ``model_config`` on one of ``tp_size`` ranks
        (``kv_reads.ReadCap``: query heads per KV head on a rank and head_dim set its
        tiles)."""
        heads = max(1, int(model_config.num_attention_heads) // tp_size)
        group = heads // max(1, int(model_config.get_num_kv_heads(tp_size)))
        return read_cap(
            group,
            int(model_config.head_dim),
            self.phase2_read_budget,
            self.phase2_read_min_tokens,
        )

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


# The declarations of PicServerSettings' fields (all but ``config``), in field order.
SERVER_SETTINGS: tuple[Setting, ...] = declared(PicServerSettings)
