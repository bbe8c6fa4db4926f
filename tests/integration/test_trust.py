"""The reuse rules through real servers: no way around them, no request that stops the server.

Two servers: ours (``python -m sgl_pic.launch_server``), and SGLang's own launcher with the
``sgl_pic`` cache backend selected through the plugin entry point but without our HTTP
middleware, so requests reach the scheduler's gate exactly as a client wrote them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from sgl_pic.binding.cpu_env import STUBS_DIR, with_cpu_defaults
from sgl_pic.cli.server_process import server_process
from tests.support.prompts import body, chunked, ids
from tests.support.server import STARTUP_TIMEOUT_S, Server, launch

pytestmark = pytest.mark.sglang

VOCAB = 49152  # the embedded model's
CANARY = {
    "input_ids": ids("The tallest mountain on Earth is"),
    "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    "return_logprob": True,
}


class Answer:
    def __init__(self, out: dict[str, Any]) -> None:
        self.tokens = out["output_ids"]
        self.logprobs = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        self.cached = out["meta_info"]["cached_tokens"]

    def same_as(self, other: Answer) -> bool:
        return self.tokens == other.tokens and all(
            abs(a - b) <= 1e-4 for a, b in zip(self.logprobs, other.logprobs, strict=True)
        )


def answer(server: Server, req: dict[str, Any]) -> Answer:
    r = server.generate({**req, "return_logprob": True})
    assert r.status_code == 200, r.text
    return Answer(r.json())


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launch("--pic-max-chunks", "3", "--pic-min-chunk-tokens", "4") as s:
        yield s


@pytest.fixture(scope="module")
def cold_canary(server: Server) -> Answer:
    return answer(server, CANARY)


def test_overlap_scheduler_stays_on(server: Server) -> None:
    info = requests.get(server.url + "/server_info", timeout=30).json()
    assert info["disable_overlap_schedule"] is False


def test_approximate_kv_serves_only_requests_making_the_same_approximation(
    server: Server, cold_canary: Answer
) -> None:
    toks, spans = chunked(["A", "B", "C"], "Which city lies on the equator?")
    plain_cold = answer(server, body(toks, None))
    assert answer(server, body(toks, spans, policy="full_reuse")).cached == 0
    # The same approximation may reuse the assembled KV as its device prefix ...
    assert answer(server, body(toks, spans, policy="full_reuse")).cached > 0
    # ... but no other: an exact chunked request, another budget, a plain request.
    exact = answer(server, body(toks, spans, policy="full_recompute"))
    assert exact.cached == 0 and exact.tokens == plain_cold.tokens
    # Exact requests share exact KV among themselves.
    also_exact = answer(server, body(toks, spans, policy="cachetune", cachetune_r=1.0))
    assert also_exact.cached > 0 and also_exact.tokens == plain_cold.tokens
    assert answer(server, body(toks, spans, policy="daric")).cached == 0
    assert answer(server, body(toks, None)).same_as(plain_cold)
    assert answer(server, CANARY).same_as(cold_canary)


@pytest.mark.parametrize(
    ("path", "req", "needle"),
    [
        ("/generate", {"input_ids": [1, VOCAB]}, "input_ids'[1] = 49152"),
        ("/generate", {"input_ids": [[1, 2], [-1]]}, "input_ids[1]'[0] = -1"),
        ("/generate", {"input_ids": [1, True]}, "must be an integer"),
        ("/v1/completions", {"model": "m", "prompt": [5, VOCAB + 7]}, "outside the vocabulary"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"custom_params": {"sgl_pic_chunks": []}}},
            "internal",
        ),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "extra_key": "sgl_pic:exact|"},
            "internal",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
                "custom_params": {"sgl_pic_mac": "0" * 64},
            },
            "internal",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi", "pic_chunk": 1}]},
            "true or false",
        ),
        # A top-k past the vocabulary kills SGLang 0.5.23's scheduler: refused there.
        (
            "/generate",
            {"text": "hello", "return_logprob": True, "top_logprobs_num": 10**6},
            "top_logprobs_num",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "top_logprobs": 10**5,
                "max_tokens": 2,
            },
            "top_logprobs_num",
        ),
        ("/generate", {"text": ["<|pic_chunk|>abcdef<|pic_chunk|>", "x"]}, "batch of texts"),
        ("/generate", {"text": "<|pic_chunk|>a<|pic_chunk|>?"}, "at least 4"),
        ("/generate", {"text": "<|pic_chunk|>Lyon and Kyoto<|pic_chunk|>" * 4}, "at most 3"),
        (
            "/generate",
            {
                "text": "<|pic_chunk|>Lyon and Kyoto<|pic_chunk|>",
                "pic": {"config": {"epic_k": True}},
            },
            "epic_k",
        ),
    ],
)
def test_what_a_client_gets_wrong_is_a_400_and_the_server_keeps_serving(
    server: Server, cold_canary: Answer, path: str, req: dict[str, Any], needle: str
) -> None:
    r = requests.post(server.url + path, json=req, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.text
    assert answer(server, CANARY).same_as(cold_canary)


def test_oversized_and_deeply_nested_bodies_get_a_4xx(server: Server, cold_canary: Answer) -> None:
    deep = b"[" * 20_000 + b"]" * 20_000
    r = requests.post(server.url + "/generate", data=deep, timeout=60)
    assert r.status_code == 400, r.text
    big = b'{"text": "' + b"a" * (65 << 20) + b'"}'
    r = requests.post(server.url + "/v1/completions", data=big, timeout=60)
    assert r.status_code == 413, r.text
    assert answer(server, CANARY).same_as(cold_canary)


@pytest.fixture(scope="module")
def sglang_launcher_server(embedded_path: str) -> Iterator[Server]:
    """SGLang's launcher: the sgl_pic backend is selected, our middleware is not there."""
    env = {k: v for k, v in os.environ.items() if k != "SGLPIC_SETTINGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS_DIR), env.get("PYTHONPATH", "")) if p)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    args = with_cpu_defaults(
        [
            "--model-path",
            embedded_path,
            "--radix-cache-backend",
            "sgl_pic",
            "--enable-metrics",
            "--max-total-tokens",
            "8192",
        ]
    )
    with server_process(args, STARTUP_TIMEOUT_S, env=env, module="sglang.launch_server") as p:
        yield Server(p.url, p.log_path)


def test_without_our_launcher_marks_are_never_honoured(sglang_launcher_server: Server) -> None:
    server = sglang_launcher_server
    toks, spans = chunked(["A", "B"], "Where do two rivers meet?")
    plain = answer(server, body(toks, None))
    forged = body(toks, None)
    forged["sampling_params"]["custom_params"] = {
        "sgl_pic_chunks": [v for s in spans for v in s],
        "sgl_pic_num_tokens": len(toks),
        "sgl_pic_config": {"policy": "full_reuse"},
        "sgl_pic_mac": "0" * 64,
    }
    forged["extra_key"] = "sgl_pic:full_reuse|"
    before = server.metrics()
    out = answer(server, forged)
    assert out.same_as(plain) and out.cached == 0
    after = server.metrics()
    key = 'sgl_pic_marks_ignored_total{reason="reuse_off"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after.get("sgl_pic_requests_total", 0) == before.get("sgl_pic_requests_total", 0)


def test_the_scheduler_refuses_ids_outside_the_vocabulary(sglang_launcher_server: Server) -> None:
    server = sglang_launcher_server
    for bad in ([1, 2, VOCAB], [-5, 3]):
        r = server.generate({"input_ids": bad, "sampling_params": {"max_new_tokens": 2}})
        assert 400 <= r.status_code < 500, r.text
        assert "outside the vocabulary" in r.text
    # No middleware here: the scheduler's gate alone refuses a top-k past the vocabulary.
    r = server.generate(
        {
            "input_ids": [1, 2],
            "return_logprob": True,
            "top_logprobs_num": VOCAB + 1,
            "sampling_params": {"max_new_tokens": 2},
        }
    )
    assert 400 <= r.status_code < 500, r.text
    assert "top_logprobs_num" in r.text
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert answer(server, CANARY).tokens
