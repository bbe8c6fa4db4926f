"""The trends of a soak's sampled series recomputed from its JSON with the current rules
(``soak_sampler.trends``): capped series judged against their caps, the others from the
moment the caches were full.

    python bench/soak_trends.py bench/results/soak.json --caps chunk_node_tokens=16384 \\
        host_tier_bytes=268435456 disk_tier_bytes=805306368 disk_dir_bytes=805306368

Launch times: the servers' "started" events; each store launch at its first sample.
Prints every bounded series that grows, and each series' trend with ``--all``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path
from soak_sampler import BOUNDED, Sample, trends  # noqa: E402


def starts_of(result: dict) -> dict[tuple[str, int], float]:
    """(source, launch) -> when it began serving, from a soak result."""
    out: dict[tuple[str, int], float] = {}
    launches: dict[str, int] = {}
    for e in result["server_events"]:
        if e["what"] == "started":
            launches[e["server"]] = launches.get(e["server"], 0) + 1
            out[(e["server"], launches[e["server"]])] = e["t"]
    for s in result["series"]:
        out.setdefault((s["source"], s["generation"]), s["t"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--caps", nargs="*", default=[], help="series=cap (omit: the run's own)")
    ap.add_argument("--all", action="store_true", help="every bounded series, not only growth")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    caps = dict(result.get("series_caps") or {})
    caps.update({k: float(v) for k, v in (c.split("=", 1) for c in args.caps)})
    samples = [Sample(s["t"], s["source"], s["generation"], s["values"]) for s in result["series"]]
    warmup_s = float(result["settings"]["warmup_minutes"]) * 60
    found = trends(samples, starts_of(result), warmup_s, caps)
    grown = 0
    for source, per in found.items():
        for name, t in per.items():
            if name not in BOUNDED or not (t["grows"] or args.all):
                continue
            grown += t["grows"]
            growth = "-" if t["growth"] is None else f"{t['growth']:+.3f}"
            print(
                f"{'GROWS' if t['grows'] else 'ok   '} {source}/{name}: first {t['first']:.4g} "
                f"last {t['last']:.4g} growth {growth} slope/min {t['slope_per_min']:.4g} "
                f"cap {t['cap']} since_t {t['since_t']}"
            )
    print(f"series grown: {grown}")
    return 1 if grown else 0


if __name__ == "__main__":
    raise SystemExit(main())
