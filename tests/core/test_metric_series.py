"""sgl_pic's series made from their declarations (``sgl_pic.core.metric_series``): the
same names, kinds, help, labels, buckets and gauge modes as the hand-written
``PicMetrics.__init__`` of f33133e exported, but for the changes made since, listed in
``SINCE``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Counter

from sgl_pic.core.metric_series import PicSeries, Series, declared_series, markdown_table

BEFORE = json.loads((Path(__file__).parent / "data" / "metric_series_f33133e.json").read_text())
# Changed since that capture: requests split into prefill pieces are planned whole at their
# first piece (``engine.pieces``), so such a piece is no longer a fallback; two counters
# say how often a request was split and how many pieces ran.
ADDED = ("split_requests", "pieces")
# And at the end, the first-token entropy of requests served by reuse (``since``).
HELP = {
    "fallbacks": "Chunked request pieces run without reuse (input logprobs, or no scratch row "
    "or slots to plan a request split into prefill pieces)",
}


def since() -> list[dict[str, Any]]:
    """The capture with the changes made since."""
    out = []
    for entry in BEFORE["series"]:
        entry = dict(entry)
        entry["help"] = HELP.get(entry["attr"], entry["help"])
        out.append(entry)
        if entry["attr"] == "fallbacks":
            for attr, name in zip(
                ADDED, ("sgl_pic_split_requests", "sgl_pic_prefill_pieces"), strict=True
            ):
                out.append({**entry, "attr": attr, "name": name, "help": None})
    # Issue 46: the served drift signal's distribution.
    out.append(
        {
            "attr": "first_token_entropy",
            "name": "sgl_pic_first_token_entropy",
            "kind": "histogram",
            "help": None,
            "labels": [],
            "multiprocess_mode": None,
            "buckets": [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf],
        }
    )
    # Issue 56: weight updates re-key the tiers.
    out.append(
        {
            "attr": "weight_updates",
            "name": "sgl_pic_weight_updates",
            "kind": "counter",
            "help": None,
            "labels": ["source"],
            "multiprocess_mode": None,
            "buckets": None,
        }
    )
    return out


def describe(attr: str, obj: Any) -> dict[str, Any]:
    bounds = list(getattr(obj, "_upper_bounds", [])) or None
    return {
        "attr": attr,
        "name": obj._name,
        "kind": obj._type,
        "help": obj._documentation,
        "labels": list(obj._labelnames),
        "multiprocess_mode": getattr(obj, "_multiprocess_mode", None),
        "buckets": bounds,
    }


def test_the_series_are_the_ones_exported_before(metrics: Any) -> None:
    got = [describe(attr, getattr(metrics, attr)) for attr, _ in declared_series()]
    want = since()
    for g, w in zip(got, want, strict=True):
        if w["help"] is None:  # an added series: its help is its declaration's
            w["help"] = g["help"]
    assert got == want  # same order, too
    assert BEFORE["series"][-1]["buckets"] is None
    selection = next(s for s in BEFORE["series"] if s["kind"] == "histogram")
    assert math.isinf(selection["buckets"][-1])


def test_each_declaration_is_registered_once(metrics: Any) -> None:
    exported = {f.name for f in REGISTRY.collect() if f.name.startswith("sgl_pic_")}
    declared = {s.name for _, s in declared_series()}
    assert declared <= exported
    assert len(declared) == len(declared_series()) == len(BEFORE["series"]) + len(ADDED) + 2


def test_an_attribute_is_its_declaration_on_the_class_and_its_object_on_an_instance(
    metrics: Any,
) -> None:
    assert isinstance(PicSeries.hits, Series) and PicSeries.hits.labels == ("kind",)
    assert isinstance(metrics.hits, Counter)
    assert PicSeries.requests.exported == "sgl_pic_requests_total"


def test_the_markdown_table_lists_every_series() -> None:
    table = markdown_table()
    assert all(f"`{s.exported}`" in table for _, s in declared_series())
    assert table.count("\n") == len(declared_series()) + 2
