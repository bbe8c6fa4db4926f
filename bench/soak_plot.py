"""The soak's sampled series drawn (``bench/soak.py``): one panel per series, a line per
server launch, the fault windows shaded. matplotlib comes with the bench extra."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from soak_sampler import Sample

PANELS = (
    ("rss_bytes", "RSS, process group (MiB)", 1 / 2**20),
    ("max_process_rss_bytes", "largest process RSS (MiB)", 1 / 2**20),
    ("fds", "open file descriptors", 1.0),
    ("threads", "threads", 1.0),
    ("kv_token_usage", "KV pool usage (share)", 1.0),
    ("chunk_node_tokens", "chunk-node slots", 1.0),
    ("host_tier_bytes", "host tier (MiB)", 1 / 2**20),
    ("disk_tier_bytes", "disk tier (MiB)", 1 / 2**20),
)


def plot(samples: Sequence[Sample], windows: Sequence[dict[str, Any]], out: Path) -> Path:
    """Writes the figure to ``out`` (PNG) and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS) // 2, 2, figsize=(13, 2.6 * len(PANELS) // 2))
    for ax, (key, title, scale) in zip(axes.flat, PANELS, strict=True):
        lines: dict[str, tuple[list[float], list[float]]] = {}
        for s in samples:
            if key in s.values:
                ts, vs = lines.setdefault(f"{s.source}#{s.generation}", ([], []))
                ts.append(s.t)
                vs.append(s.values[key] * scale)
        for name, (ts, vs) in sorted(lines.items()):
            ax.plot(ts, vs, label=name, lw=1)
        for w in windows:
            end = w["end"] if w["end"] is not None else w["start"]
            ax.axvspan(w["start"], max(end, w["start"] + 1), color="tab:red", alpha=0.12)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        if lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the run began (shaded: fault windows)", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
