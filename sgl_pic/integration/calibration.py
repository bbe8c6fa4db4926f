"""``--pic-calibrate``: CacheTune's recompute ratio per tier, chosen at server start-up.

Runs ``sgl_pic.calibrate.calibrate`` for the served model's shape: load costs are measured
on the server's own load path (``LowerTiers`` placements read by a ``LayerFeed`` into a
scratch pool) over real host-memory and disk tiers (the disk one in the configured disk
directory, so the same device is measured), with the server's segment length; the compute
cost by the labelled matmul proxy of one decoder layer (the engine's own layer needs a
forward batch, which does not exist at start-up).
The golden-section search runs over [cachetune_r, 1]: the configured r is the quality
floor. Loads from chunk nodes are copies within the pool, so the device tier gets the floor.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from sgl_pic.calibrate import RESULT_FILE, ModelShape, calibrate
from sgl_pic.integration.settings import PicServerSettings
from sgl_pic.paths import cache_root
from sgl_pic.store.cost_model import SearchConfig

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512


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


def calibrate_tiers(settings: PicServerSettings, hf: Any, device: str = "cpu") -> dict[str, float]:
    """r per tier ("device", "host", "disk"); also written to calibration.json. ``device``
    is where the scratch pool lives (the KV pool's device, so the measured feed copies
    host-to-device as the server's does)."""
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
    )
    ratios = {"device": search.r_min}
    ratios.update({name: tier.r for name, tier in result.tiers.items()})
    out = directory / RESULT_FILE
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(result.to_json())
    os.replace(tmp, out)
    logger.info(
        "sgl_pic calibration (%s compute, t_c %.1f ns/token/layer): r per tier %s; wrote %s",
        result.compute_source,
        result.t_c * 1e9,
        {k: round(v, 3) for k, v in ratios.items()},
        out,
    )
    return ratios
