"""Tenants through a real server: the same marked passages sent under two tenants' keys
(native ``extra_key``) or salts (OpenAI ``cache_salt``) are computed once per tenant, and
a tenant's own later requests still reuse them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.integration.prompts import DOCS, body, chunked
from tests.integration.server import MetricDeltas, Server, launch

pytestmark = pytest.mark.sglang

TIERS = ("device", "host", "disk", "shared")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--pic-min-chunk-tokens", "4") as s:
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
