"""The drift signal copied into SGLang's own OpenAI response models (``http.openai_meta``)."""

from __future__ import annotations

import inspect
import json
import pkgutil
from typing import Any

import pytest

from sgl_pic.core.drift_signal import META_KEY
from sgl_pic.http import openai_meta

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def protocol() -> Any:
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.entrypoints.openai import protocol

    return protocol


def _result(entropies: list[float | None] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": "r", "weight_version": "default"}
    if entropies is not None:
        meta[META_KEY] = entropies
    return {"text": "x", "meta_info": meta}


def _chat(protocol: Any) -> Any:
    choice = protocol.ChatCompletionResponseChoice(
        index=0, message=protocol.ChatMessage(role="assistant", content="x"), finish_reason="stop"
    )
    return protocol.ChatCompletionResponse(
        id="r",
        model="m",
        choices=[choice, choice.model_copy(update={"index": 1})],
        usage=protocol.UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        metadata={"weight_version": "default"},
    )


def test_the_target_is_sglangs_builder_of_unstreamed_chat_responses(protocol: Any) -> None:
    """The hook's parameters are the builder's own, so SGLang moving them fails here."""
    owner, name = openai_meta.CHAT_TARGET.rsplit(".", 1)
    builder = getattr(pkgutil.resolve_name(owner), name)
    assert list(inspect.signature(builder).parameters) == ["self", "request", "ret", "created"]
    assert "metadata" in protocol.ChatCompletionResponse.model_fields
    assert "metadata" not in protocol.ChatCompletionStreamResponse.model_fields


def test_each_choice_gets_its_entropy_in_the_response_metadata(protocol: Any) -> None:
    response = _chat(protocol)
    ret = [_result([1.25]), _result([None, 0.5])]
    out = openai_meta.after_build_response(response, None, None, ret, 0)
    assert out is response
    body = json.loads(out.model_dump_json())
    # SGLang's own metadata stays; one value per choice, in the order of choices.
    assert body["metadata"] == {"weight_version": "default", META_KEY: [1.25, 0.5]}
    assert body["usage"]["prompt_tokens"] == 3


def test_a_choice_not_served_by_reuse_reads_none(protocol: Any) -> None:
    response = _chat(protocol)
    ret = [_result(None), _result([None, 0.75])]
    out = openai_meta.after_build_response(response, None, None, ret, 0)
    assert out.metadata[META_KEY] == [None, 0.75]


def test_a_response_without_reuse_is_left_as_sglang_built_it(protocol: Any) -> None:
    response = _chat(protocol)
    before = response.model_dump_json()
    out = openai_meta.after_build_response(response, None, None, [_result(None)] * 2, 0)
    assert out.model_dump_json() == before
    out = openai_meta.after_build_response(response, None, None, [_result([None])] * 2, 0)
    assert out.model_dump_json() == before


def test_an_error_response_comes_back_unchanged(protocol: Any) -> None:
    from fastapi.responses import ORJSONResponse

    error = ORJSONResponse({"error": "bad"}, status_code=400)
    assert openai_meta.after_build_response(error, None, None, [_result([1.0])], 0) is error


def test_plugin_registers_the_hook_on_the_chat_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_pic.binding import plugin

    calls: list[tuple[str, Any, Any]] = []
    monkeypatch.setattr(registry, "get_radix_cache_factory", lambda name: None)
    monkeypatch.setattr(registry, "register_radix_cache_backend", lambda name, f: None)
    monkeypatch.setattr(
        HookRegistry, "register", lambda t, h, k=HookType.AFTER: calls.append((t, h, k))
    )
    plugin.register()
    ours = [(t, k) for t, h, k in calls if h is openai_meta.after_build_response]
    assert ours == [(openai_meta.CHAT_TARGET, HookType.AFTER)]


def test_sglangs_hook_registry_wraps_the_builder(
    monkeypatch: pytest.MonkeyPatch, protocol: Any
) -> None:
    """SGLang's real registry applies the hook to its real serving class, and its AFTER
    wrapper hands the hook the builder's arguments, positional (as SGLang calls it) or
    named."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    owner, name = openai_meta.CHAT_TARGET.rsplit(".", 1)
    cls = pkgutil.resolve_name(owner)
    # The builder itself needs a whole serving object: a stand-in with its signature (the
    # real one's parameters are pinned above); monkeypatch puts the real one back.
    monkeypatch.setattr(cls, name, lambda self, request, ret, created: _chat(protocol))
    stand_in = getattr(cls, name)
    HookRegistry.register(openai_meta.CHAT_TARGET, openai_meta.after_build_response, HookType.AFTER)
    HookRegistry.apply_hooks()
    wrapped = getattr(cls, name)
    assert wrapped is not stand_in and wrapped.__wrapped__ is stand_in
    serving = object.__new__(cls)
    ret = [_result([1.5]), _result(None)]
    by_position = serving._build_chat_response(None, ret, 0)
    by_name = serving._build_chat_response(request=None, ret=ret, created=0)
    for out in (by_position, by_name):
        assert out.metadata == {"weight_version": "default", META_KEY: [1.5, None]}


def test_a_failure_in_the_hook_returns_sglangs_response(
    protocol: Any, caplog: pytest.LogCaptureFixture
) -> None:
    response = _chat(protocol)
    before = response.model_dump_json()
    broken = [{"meta_info": {META_KEY: ["not a number"]}}]
    assert openai_meta.after_build_response(response, None, None, broken, 0) is response
    assert response.model_dump_json() == before
    assert "drift signal was not added" in caplog.text
