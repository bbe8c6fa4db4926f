"""Tenants through a real server: the same marked passages sent under two tenants' keys
(native ``extra_key``) or salts (OpenAI ``cache_salt``) are computed once per tenant, and
a tenant's own later requests still reuse them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from sgl_pic.core.tenants import isolation_namespace
from tests.support.prompts import DOCS, body, chunked, ids
from tests.support.server import MetricDeltas, Server, launch

pytestmark = pytest.mark.sglang

TIERS = ("device", "host", "disk", "shared")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--pic-min-chunk-tokens", "4", "--pic-namespace-metrics", "64") as s:
        yield s


def hits(delta: MetricDeltas) -> float:
    """Chunks reused from any tier."""
    return sum(delta[f'sgl_pic_tier_hits_total{{tier="{t}"}}'] for t in TIERS)


def generate(server: Server, header: str, extra_key: str | None) -> MetricDeltas:
    # A header of its own per request: the prefix tree never covers the chunks, so every
    # reuse is a chunk hit.
    toks, spans = chunked(["A", "B"], "Which of these cities is older?", header=header)
    req = body(toks, spans, policy="full_reuse")
    if extra_key is not None:
        req["extra_key"] = extra_key
    return server.send(req).delta


def chat(server: Server, opening: str, cache_salt: str | None) -> MetricDeltas:
    req: dict[str, Any] = {
        "model": "default",
        "messages": [
            {"role": "system", "content": opening},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": DOCS["C"], "pic_chunk": True},
                    {"type": "text", "text": DOCS["D"], "pic_chunk": True},
                    {"type": "text", "text": "Which of the two lies further north?"},
                ],
            },
        ],
        "temperature": 0,
        "max_tokens": 4,
    }
    if cache_salt is not None:
        req["cache_salt"] = cache_salt
    before = server.metrics()
    r = requests.post(server.url + "/v1/chat/completions", json=req, timeout=300)
    assert r.status_code == 200, r.text
    after = server.metrics()
    return MetricDeltas(
        {k: after.get(k, 0.0) - before.get(k, 0.0) for k in before.keys() | after.keys()}
    )


def test_native_extra_keys_never_share_chunks(server: Server) -> None:
    first = generate(server, "Request one.", "tenant-A")
    assert hits(first) == 0 and first["sgl_pic_chunk_misses_total"] == 2
    assert hits(generate(server, "Request two.", "tenant-A")) == 2
    other = generate(server, "Request three.", "tenant-B")
    assert hits(other) == 0 and other["sgl_pic_chunk_misses_total"] == 2
    assert hits(generate(server, "Request four.", "tenant-A")) == 2
    assert hits(generate(server, "Request five.", "tenant-B")) == 2
    # Requests without a key share the default namespace, apart from both tenants.
    assert hits(generate(server, "Request six.", None)) == 0
    assert hits(generate(server, "Request seven.", None)) == 2


def test_openai_cache_salts_never_share_chunks(server: Server) -> None:
    assert hits(chat(server, "You answer briefly.", "tenant-A")) == 0
    assert hits(chat(server, "You answer in one word.", "tenant-A")) == 2
    assert hits(chat(server, "You answer carefully.", "tenant-B")) == 0
    assert hits(chat(server, "You answer at once.", "tenant-A")) == 2
    # A salt is a namespace of its own, apart from a native key of the same name.
    assert hits(chat(server, "You answer plainly.", None)) == 0


def delete(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(server.url + "/pic/delete", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["deleted"]


def removed(report: dict[str, Any]) -> int:
    return sum(t["records"] for t in report["tiers"].values())


def test_deletion_by_namespace_and_by_content(server: Server) -> None:
    first = generate(server, "Deletion one.", "del-A")
    assert first["sgl_pic_chunk_misses_total"] == 2
    # Per-namespace series (--pic-namespace-metrics): a digest prefix, never the key.
    label = isolation_namespace("del-A", None)[:12]
    assert first[f'sgl_pic_namespace_chunk_misses_total{{namespace="{label}"}}'] == 2
    assert not any("del-A" in k for k in server.metrics())
    assert hits(generate(server, "Deletion two.", "del-A")) == 2
    tokens = server.metrics()[f'sgl_pic_namespace_chunk_node_tokens{{namespace="{label}"}}']
    assert tokens > 0
    assert generate(server, "Deletion three.", "del-B")["sgl_pic_chunk_misses_total"] == 2

    # A client cannot send the order itself: refused at the edge, nothing deleted.
    forged = {"sgl_pic_delete": '{"namespaces":null,"contents":null}', "sgl_pic_delete_mac": "0"}
    r = server.generate({"input_ids": [1], "sampling_params": {"custom_params": forged}})
    assert 400 <= r.status_code < 500, r.text
    assert hits(generate(server, "Deletion four.", "del-A")) == 2

    # By namespace: tenant A's chunks go from every tier; A recomputes, B still hits.
    before = server.metrics()
    report = delete(server, {"namespace": {"extra_key": "del-A"}})
    assert report["tiers"]["device"]["records"] > 0 and report["tiers"]["host"]["records"] > 0
    moved = server.metrics()['sgl_pic_deleted_records_total{tier="device"}']
    assert (
        moved - before.get('sgl_pic_deleted_records_total{tier="device"}', 0)
        == (report["tiers"]["device"]["records"])
    )
    after = generate(server, "Deletion five.", "del-A")
    assert hits(after) == 0 and after["sgl_pic_chunk_misses_total"] == 2
    assert hits(generate(server, "Deletion six.", "del-B")) == 2

    # By content as text (every namespace): chunk A, tokenized as the edge tokenizes it.
    report = delete(server, {"text": DOCS["A"] + "\n"})
    assert removed(report) > 0
    for tenant in ("del-A", "del-B"):
        after = generate(server, f"Deletion seven, {tenant}.", tenant)
        assert hits(after) == 1 and after["sgl_pic_chunk_misses_total"] == 1

    # By content as token ids, in one namespace only: B loses chunk B, A keeps it.
    report = delete(
        server, {"namespace": {"extra_key": "del-B"}, "input_ids": [ids(DOCS["B"] + "\n")]}
    )
    assert removed(report) > 0
    after = generate(server, "Deletion eight.", "del-B")
    assert hits(after) == 1 and after["sgl_pic_chunk_misses_total"] == 1
    assert hits(generate(server, "Deletion nine.", "del-A")) == 2


def test_malformed_deletions_get_a_400(server: Server) -> None:
    for bad in ({}, {"namespace": "del-A"}, {"input_ids": [-1]}):
        r = requests.post(server.url + "/pic/delete", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
