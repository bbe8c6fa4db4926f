"""POST /pic/delete on a FastAPI app guarded by SGLang's own API-key middleware (as
SGLang's launcher adds it), the internal request replaced by a stand-in gate."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sgl_pic.config import PicConfig
from sgl_pic.core import delete_command
from sgl_pic.core.spans import MarkSigner
from sgl_pic.http import delete_route as delete_http
from sgl_pic.http.middleware import PicHTTPMiddleware
from sgl_pic.http.request_translator import RequestTranslator
from sgl_pic.store.deletion import Deletion

pytestmark = pytest.mark.sglang  # SGLang's auth middleware

SIGNER = MarkSigner("secret")
CONFIG = PicConfig()


class FakeTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


class Scheduler:
    """Stands in for the gate on the far side of the tokenizer manager: opens the order
    with the launch's signer and answers with a report, as ``AdmissionGate`` does."""

    def __init__(self, replicas: int = 1) -> None:
        self.orders: list[Deletion] = []
        self.replicas = replicas

    async def submit(self, custom: dict[str, Any]) -> list[str | None]:
        out: list[str | None] = []
        for _ in range(self.replicas):
            order = delete_command.decode(custom, SIGNER)
            self.orders.append(order)
            report = {"tiers": {"device": {"records": 2}}, "prefix_tree_evicted_tokens": 5}
            out.append(delete_command.report_message(report))
        return out


def client(
    monkeypatch: pytest.MonkeyPatch,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    vocab_size: int | None = 1000,
) -> tuple[TestClient, Scheduler]:
    from sglang.srt.utils.auth import add_api_key_middleware

    sched = Scheduler()
    monkeypatch.setattr(delete_http, "submit_internal", sched.submit)
    app = FastAPI()
    translator = RequestTranslator(CONFIG, FakeTokenizer, signer=SIGNER, vocab_size=vocab_size)
    delete_http.install(app, translator, SIGNER, CONFIG.segment_tokens)
    app.add_middleware(PicHTTPMiddleware, translator=translator)
    if api_key or admin_api_key:
        # As SGLang's launcher does, after our middleware (so it runs first).
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    return TestClient(app), sched


def post(c: TestClient, body: Any, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post(delete_http.DELETE_PATH, content=data, headers=headers)


def test_a_deletion_answers_with_the_schedulers_report(monkeypatch: pytest.MonkeyPatch) -> None:
    c, sched = client(monkeypatch)
    r = post(c, {"namespace": {"extra_key": "A"}, "text": "hello world"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "deleted": {"tiers": {"device": {"records": 2}}, "prefix_tree_evicted_tokens": 5},
        "replicas": 1,
    }
    (order,) = sched.orders
    assert order.namespaces is not None and order.contents is not None


@pytest.mark.parametrize(
    "body", [b"{not json", {}, {"namespace": 1}, {"input_ids": [-1]}, {"text": "\ud800"}]
)
def test_malformed_bodies_get_a_400_and_nothing_is_sent(
    monkeypatch: pytest.MonkeyPatch, body: Any
) -> None:
    c, sched = client(monkeypatch)
    r = post(c, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] and sched.orders == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"namespace": {"extra_key": "\\ud800"}}',  # a lone surrogate in a tenant's key
        {"input_ids": [2**32]},  # past 32 bits, where the vocabulary is unknown
        {"input_ids": [10**23]},
        # more segments than one order may name (its tombstone must stay small)
        {"input_ids": [[i] for i in range(9000)]},
    ],
)
def test_bodies_that_once_raised_in_the_route_get_a_400(
    monkeypatch: pytest.MonkeyPatch, body: Any
) -> None:
    c, sched = client(monkeypatch, vocab_size=None)
    r = post(c, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] and sched.orders == []


def test_raw_command_keys_from_a_client_are_refused_at_the_edge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, sched = client(monkeypatch)
    custom = {delete_command.COMMAND_KEY: '{"namespaces":[""],"contents":null}'}
    r = c.post("/generate", json={"input_ids": [1], "sampling_params": {"custom_params": custom}})
    assert r.status_code == 400 and "internal" in r.text and sched.orders == []


@pytest.mark.parametrize(
    ("api_key", "admin_api_key", "sent", "status"),
    [
        (None, None, None, 200),  # no keys: open, as /flush_cache
        ("user", None, None, 401),
        ("user", None, "user", 200),
        (None, "admin", None, 401),
        (None, "admin", "admin", 200),
        ("user", "admin", "user", 401),  # both set: the admin key only
        ("user", "admin", "admin", 200),
    ],
)
def test_guarded_as_sglangs_admin_endpoints(
    monkeypatch: pytest.MonkeyPatch,
    api_key: str | None,
    admin_api_key: str | None,
    sent: str | None,
    status: int,
) -> None:
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    c, sched = client(monkeypatch, api_key, admin_api_key)
    r = post(c, {"namespace": {}}, sent)
    assert r.status_code == status, r.text
    assert len(sched.orders) == (status == 200)
    # The rule SGLang applies to /flush_cache (ADMIN_OPTIONAL) gives the same answer.
    flush = decide_request_auth(
        method="POST",
        path="/flush_cache",
        authorization_header=f"Bearer {sent}" if sent else None,
        api_key=api_key,
        admin_api_key=admin_api_key,
        auth_level=AuthLevel.ADMIN_OPTIONAL,
    )
    assert flush.allowed == (status == 200)


def test_a_refusal_that_is_no_report_is_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    c, _ = client(monkeypatch)

    async def unavailable(custom: dict[str, Any]) -> list[str | None]:
        return ["deletion unavailable: chunk reuse is off on this server"]

    async def ran(custom: dict[str, Any]) -> list[str | None]:
        return [None]

    for submit, words in ((unavailable, "unavailable"), (ran, "not active")):
        monkeypatch.setattr(delete_http, "submit_internal", submit)
        r = post(c, {"namespace": {}})
        assert r.status_code == 503 and words in r.json()["error"]["message"]


def test_every_data_parallel_replica_deletes_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    c, _ = client(monkeypatch)
    sched = Scheduler(replicas=3)
    monkeypatch.setattr(delete_http, "submit_internal", sched.submit)
    r = post(c, {"namespace": {}})
    assert r.status_code == 200 and len(sched.orders) == 3
    assert r.json() == {
        "deleted": {"tiers": {"device": {"records": 6}}, "prefix_tree_evicted_tokens": 15},
        "replicas": 3,
    }

    async def one_missing(custom: dict[str, Any]) -> list[str | None]:
        return [*(await sched.submit(custom))[:1], None]

    monkeypatch.setattr(delete_http, "submit_internal", one_missing)
    r = post(c, {"namespace": {}})
    assert r.status_code == 503 and "replica 1" in r.json()["error"]["message"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_order_rides_one_internal_request_per_replica(
    monkeypatch: pytest.MonkeyPatch, replicas: int
) -> None:
    """``submit_internal`` on a stand-in tokenizer manager that refuses as SGLang's does
    (a ValueError carrying the gate's message)."""
    import asyncio

    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.entrypoints import http_server

    sent: list[Any] = []

    class Manager:
        elastic_worker_count = replicas

        async def generate_request(self, obj: Any, request: Any) -> Any:
            sent.append(obj)
            raise ValueError(f"refused on {obj.routed_dp_rank}")
            yield  # an async generator, as SGLang's

    monkeypatch.setattr(
        http_server, "get_global_state", lambda: SimpleNamespace(tokenizer_manager=Manager())
    )
    custom = delete_command.encode(Deletion(namespaces=frozenset({""})), SIGNER)
    out = asyncio.run(delete_http.submit_internal(custom))
    ranks = [None] if replicas == 1 else list(range(replicas))
    assert out == [f"refused on {r}" for r in ranks]
    assert [o.routed_dp_rank for o in sent] == ranks
    assert all(o.sampling_params["custom_params"] == custom and o.input_ids == [0] for o in sent)
