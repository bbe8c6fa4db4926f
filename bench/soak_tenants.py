"""Tenants in the soak (``bench/soak.py --tenants N``): salted traffic and a probe that
counts cross-tenant chunk hits.

With N tenants, every chunked, chat or plain request of the mix is sent, at random, as
one of them (``extra_key`` or ``cache_salt`` on /generate, ``cache_salt`` on chat) or as
no tenant at all (the default namespace).

The server reports chunk hits only as global counters, so the probe makes them
attributable: every ``--tenant-probe-every`` seconds it pauses the mix (``Quiesce``:
new requests wait, those in flight finish), then, alone on the server, sends fresh
chunks (passages with a text nobody else sends) as tenant X, the same chunks under
another header as tenant Y, and once more as X. Y's chunk hits (any tier, read from
/metrics around its request) are cross-tenant hits and must be 0; X's second request
reusing its own chunks is counted as a same-tenant hit (informative: store admission may
have deferred a first sight). Then the operator deletes X's chunks (``POST /pic/delete``,
by X's namespace on odd probes, by the chunks' token ids within X's namespace on even
ones) and X sends them once more: any chunk hit then is a deleted chunk served again and
must be 0.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import requests

TIERS = ("device", "host", "disk", "shared")


class Quiesce:
    """Requests of the mix run inside ``request()``; ``alone()`` waits until none is in
    flight and holds new ones back while its body runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._paused = False

    @contextmanager
    def request(self) -> Iterator[None]:
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._paused = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()


def salt(body: dict[str, Any], rng: random.Random, tenants: int, chat: bool) -> str:
    """Puts one tenant's key or salt on ``body`` (or none: the default namespace, about one
    request in N + 1); returns the variant for the record."""
    if tenants <= 0:
        return ""
    i = rng.randrange(tenants + 1)
    if i == tenants:
        return "default"
    field = "cache_salt" if chat or rng.random() < 0.5 else "extra_key"
    body[field] = f"tenant-{i}"
    return field


class ProbeResult(NamedTuple):
    t: float
    outcome: str  # ok | cross_tenant_hit | deleted_hit | error
    cross_hits: float  # chunk hits of tenant Y's request on X's chunks
    same_hits: float  # chunk hits of X's repeat
    detail: str
    deleted_records: int = 0  # records the deletion reported removed, all tiers
    deleted_hits: float = 0.0  # chunk hits of X's request after its chunks were deleted


def _hits(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=60).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sgl_pic_tier_hits_total{") and any(
            f'tier="{t}"' in line for t in TIERS
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def probe(
    url: str,
    n: int,
    ids: Callable[[str], list[int]],
    passages: list[str],
    question_ids: list[int],
    timeout: float,
    t: float,
) -> ProbeResult:
    """One probe (the caller holds ``Quiesce.alone``): fresh chunks as tenant X, as Y,
    as X again."""
    rng = random.Random(n)
    tenants = [f"tenant-{i}" for i in range(2)]
    x, y = rng.sample(tenants, 2)
    chunks = [ids(f"[probe {n}.{i}] {p}\n") for i, p in enumerate(rng.sample(passages, 2))]

    def send(header: str, field: str, tenant: str) -> float:
        toks = ids(header)
        spans = []
        for c in chunks:
            spans.append([len(toks), len(toks) + len(c)])
            toks = toks + c
        body = {
            "input_ids": toks + question_ids,
            "pic": {"chunks": spans, "config": {"policy": "full_reuse"}},
            "sampling_params": {"temperature": 0, "max_new_tokens": 2},
            field: tenant,
        }
        before = _hits(url)
        r = requests.post(url + "/generate", json=body, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"probe request answered {r.status_code}: {r.text[:200]}")
        return _hits(url) - before

    def delete() -> int:
        order: dict[str, Any] = {"namespace": {field: x}}
        if n % 2 == 0:
            order["input_ids"] = chunks
        r = requests.post(url + "/pic/delete", json=order, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"deletion answered {r.status_code}: {r.text[:200]}")
        tiers = r.json()["deleted"]["tiers"].values()
        return sum(int(v.get("records", 0)) for v in tiers)

    field = rng.choice(["extra_key", "cache_salt"])
    how = "content" if n % 2 == 0 else "namespace"
    try:
        send(f"Probe {n}, first.", field, x)
        cross = send(f"Probe {n}, other tenant.", field, y)
        same = send(f"Probe {n}, same tenant.", field, x)
        removed = delete()
        after = send(f"Probe {n}, after deletion.", field, x)
    except (requests.RequestException, RuntimeError, KeyError, ValueError) as e:
        return ProbeResult(t, "error", 0.0, 0.0, f"{type(e).__name__}: {str(e)[:200]}")
    outcome = "cross_tenant_hit" if cross else "deleted_hit" if after else "ok"
    detail = f"{x} then {y} via {field}; deleted by {how}"
    return ProbeResult(t, outcome, cross, same, detail, removed, after)


def summarize(results: list[ProbeResult]) -> dict[str, Any]:
    ok = [r for r in results if r.outcome != "error"]
    return {
        "probes": len(results),
        "probe_errors": len(results) - len(ok),
        "cross_tenant_hits": sum(r.cross_hits for r in ok),
        "probes_with_cross_tenant_hits": sum(r.outcome == "cross_tenant_hit" for r in ok),
        "probes_where_the_same_tenant_hit": sum(r.same_hits > 0 for r in ok),
        "deleted_records": sum(r.deleted_records for r in ok),
        "deleted_chunk_hits": sum(r.deleted_hits for r in ok),
        "probes_with_deleted_chunk_hits": sum(r.outcome == "deleted_hit" for r in ok),
    }
