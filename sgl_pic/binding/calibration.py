"""``--pic-calibrate``: CacheTune's recompute ratio per tier, chosen at server start-up.

Runs ``sgl_pic.cli.calibrate.calibrate`` for the served model's shape: load costs are measured
on the server's own load path (``LowerTiers`` placements read by a ``LayerFeed`` into a
scratch pool) over real host-memory and disk tiers (the disk one in the configured disk
directory, so the same device is measured), with the server's segment length; the compute
cost by the labelled matmul proxy of one decoder layer (the engine's own layer needs a
forward batch, which does not exist at start-up).
The golden-section search runs over [cachetune_r, 1]: the configured r is the quality
floor. Loads from chunk nodes are copies within the pool, so the device tier gets the floor.
Everything is timed on the KV pool's device. Under tensor parallelism rank 0 measures and
every rank takes its ratios, so all ranks recompute the same tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.cli.calibrate import RESULT_FILE, ModelShape, calibrate
from sgl_pic.paths import cache_root
from sgl_pic.store.cost_model import SearchConfig

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
TIER_NAMES = ("device", "host", "disk")


def model_shape(hf: Any, dtype: str) -> ModelShape:
    """The calibration shape of a HF Llama-style config."""
    heads = int(hf.num_attention_heads)
    return ModelShape(
        num_layers=int(hf.num_hidden_layers),
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        hidden=int(hf.hidden_size),
        num_heads=heads,
        intermediate=int(hf.intermediate_size),
        dtype=dtype,
    )


def calibrate_tiers(
    settings: PicServerSettings,
    hf: Any,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rank: int = 0,
) -> dict[str, float]:
    """r per tier ("device", "host", "disk"); rank 0 also writes calibration.json.
    ``device`` is the KV pool's (the scratch pool and the compute proxy live there, so
    the measured feed copies host-to-device as the server's does) and ``dtype`` the
    model's KV dtype. ``reduce`` sums a tensor over the tensor-parallel ranks (None: one
    rank); with it only rank 0 measures and every rank returns rank 0's ratios.
    Called by each scheduler at start-up, ranks together."""
    ratios = _measure(settings, hf, device, dtype) if rank == 0 else {}
    if reduce is None:
        return ratios
    # Rank 0's values reach every rank through the sum: the others add zeros.
    mine = torch.tensor(  # [tiers, 2]: r, and whether rank 0 calibrated that tier
        [[ratios.get(name, 0.0), float(name in ratios)] for name in TIER_NAMES],
        dtype=torch.float32,
        device=device,
    )
    agreed = reduce(mine).cpu().tolist()
    return {name: r for name, (r, present) in zip(TIER_NAMES, agreed, strict=True) if present > 0.5}


def _measure(
    settings: PicServerSettings, hf: Any, device: str, dtype: torch.dtype
) -> dict[str, float]:
    directory = Path(settings.disk_cache_dir) if settings.disk_cache_dir else cache_root()
    directory.mkdir(parents=True, exist_ok=True)
    search = SearchConfig(r_min=settings.config.cachetune_r)
    # Always float32: the calibration records are built on the host, like the tiers'.
    result = calibrate(
        directory,
        model_shape(hf, "float32"),
        CALIBRATION_TOKENS,
        search,
        segment_tokens=settings.config.segment_tokens,
        device=device,
        compute_dtype=dtype,
    )
    ratios = {"device": search.r_min}
    ratios.update({name: tier.r for name, tier in result.tiers.items()})
    out = directory / RESULT_FILE
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(result.to_json())
    os.replace(tmp, out)
    logger.info(
        "sgl_pic calibration on %s (%s compute, t_c %.1f ns/token/layer): r per tier %s; wrote %s",
        device,
        result.compute_source,
        result.t_c * 1e9,
        {k: round(v, 3) for k, v in ratios.items()},
        out,
    )
    return ratios
