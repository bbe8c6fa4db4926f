"""The plugin's hooks and the runtime behind them on stand-ins (SGLang importable, no
server): a failing or stalled chunk path falls back to SGLang's own forward; the hand-off
is per batch, by request id, and checked against token ids; without a runtime every hook
is SGLang's own path."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_pic.binding import compose, hooks, plugin, tier_setup
from sgl_pic.binding.runtime import PicRuntime, current, set_current
from sgl_pic.core.gate import AdmittedMarks, Pending
from sgl_pic.core.spans import PicRequest
from sgl_pic.engine.layer_feed import FeedTimeout
from sgl_pic.engine.rank_agreement import RankAgreement
from sgl_pic.layout import PromptLayout

pytestmark = pytest.mark.sglang


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, k: int = 1) -> None:
        self.n += k

    def labels(self, **_kw: str) -> Counter:
        return self


class FakeExecutor:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.handoffs: list[dict[str, Pending]] = []  # what each forward was handed
        self.ranks = RankAgreement()  # one rank, as ``ChunkExecutor``'s default

    def forward(self, _stack: Any, _ids: Any, _fb: Any, handoff: dict[str, Pending]) -> Any:
        self.handoffs.append(dict(handoff))
        if self.error is not None:
            raise self.error
        return torch.ones(2, 4)


class FakeGate:
    def __init__(self) -> None:
        self.marks = AdmittedMarks()


def fake_metrics() -> Any:
    return SimpleNamespace(
        failures=Counter(), marks_ignored=Counter(), fallbacks=Counter(), unsupported=Counter()
    )


@pytest.fixture
def runtime() -> Iterator[PicRuntime]:
    rt = PicRuntime(
        FakeGate(),  # type: ignore[arg-type]
        fake_metrics(),
        FakeExecutor(FeedTimeout("layer 3 not loaded in 0.1 s")),
        FakePhases(),
    )
    previous = set_current(rt)
    yield rt
    set_current(previous)


class FakePhases:
    """The phase runner as ``on_extend`` sees it: no phase batch running."""

    def __init__(self) -> None:
        self.context: Any = None
        self.planned: list[Any] = []
        self.backend = SimpleNamespace(init_forward_metadata=self.planned.append)

    @property
    def batch(self) -> Any:
        return None if self.context is None else self.context.batch


def forward_batch() -> Any:
    return SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend=lambda: True),
        extend_prefix_lens_cpu=[0],
    )


def test_a_stalled_feed_runs_the_batch_as_sglang_would(runtime: PicRuntime) -> None:
    fb = forward_batch()
    out = runtime.on_extend(None, torch.tensor([1, 2]), torch.tensor([0, 1]), fb)  # type: ignore[arg-type]
    # None: the stack runs the live batch itself, with the backend planned for it again.
    assert out is None and runtime.metrics.failures.n == 1
    assert runtime.phases.planned == [fb] and runtime.phases.context is None


def test_extend_batches_reach_the_executor_unless_a_phase_runs(runtime: PicRuntime) -> None:
    runtime.executor.error = None
    out = runtime.on_extend(None, torch.tensor([1, 2]), torch.tensor([0, 1]), forward_batch())  # type: ignore[arg-type]
    assert out is not None and torch.equal(out, torch.ones(2, 4))
    # A phase forward re-enters the stack: never nested.
    runtime.phases.context = SimpleNamespace(batch=object())
    assert runtime.on_extend(None, torch.tensor([1]), torch.tensor([0]), forward_batch()) is None  # type: ignore[arg-type]
    assert len(runtime.executor.handoffs) == 1


def req(rid: str, ids: list[int]) -> Any:
    return SimpleNamespace(rid=rid, origin_input_ids=ids)


def test_hand_off_is_per_batch_by_request_id_and_token_checked(runtime: PicRuntime) -> None:
    layout = PromptLayout.from_spans(6, [[0, 4]])
    good = Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6))
    changed = Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6))
    runtime.marks.put("stale", good)  # admitted, not in this batch
    runtime.prepare_batch(SimpleNamespace(reqs=[req("stale", [1, 2, 3, 4, 5, 6])]))
    runtime.marks.put("a", good)
    runtime.marks.put("b", changed)
    batch = SimpleNamespace(
        reqs=[req("a", [1, 2, 3, 4, 5, 6]), req("b", [1, 2, 3, 4, 5, 7]), req("c", [9, 9])]
    )
    hooks.after_prepare_for_extend(None, batch)
    assert runtime.handoff == {"a": good}  # the earlier batch's is gone
    assert runtime.metrics.marks_ignored.n == 1
    # The forward takes it, once; the marks stay for the request's later extends.
    runtime.executor.error = None
    runtime.on_extend(None, torch.tensor([1]), torch.tensor([0]), forward_batch())  # type: ignore[arg-type]
    assert runtime.executor.handoffs == [{"a": good}] and runtime.handoff == {}
    assert runtime.marks.get("a") is good


def test_a_bypassed_batch_drops_its_hand_off_counted(runtime: PicRuntime) -> None:
    layout = PromptLayout.from_spans(6, [[0, 4]])
    runtime.marks.put("a", Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6)))
    runtime.prepare_batch(SimpleNamespace(reqs=[req("a", [1, 2, 3, 4, 5, 6])]))
    runtime.on_bypass(forward_batch())
    assert runtime.handoff == {} and runtime.metrics.fallbacks.n == 1


def test_hooks_pass_through_without_a_runtime() -> None:
    previous = set_current(None)
    try:
        assert hooks.admit_hook(lambda r: None, req("a", [1])) is None
        assert hooks.admit_hook(lambda r: "too long", req("a", [1])) == "too long"
        assert hooks.after_prepare_for_extend("result", SimpleNamespace(reqs=[])) == "result"
        assert hooks.prefill_graph_hook(lambda _r, _fb: True, None, forward_batch()) is True
        seen: list[Any] = []
        out = hooks.torch_native_extend_hook(
            lambda *a: seen.append(a) or "sglang", "backend", "q", "k", "v", "layer", "fb"
        )
        assert out == "sglang" and seen == [("backend", "q", "k", "v", "layer", "fb", True)]
    finally:
        set_current(previous)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_lower_tiers_rotate_keys_by_the_models_own_pairing(layout: str) -> None:
    # Phase 1 stores keys un-rotated by the model's pairing; a tier that rotates them back
    # by another pairing would hand every later request (and the chunk nodes promoted from
    # it) wrong keys.
    from sgl_pic.binding.settings import PicServerSettings
    from sgl_pic.config import PicConfig
    from sgl_pic.engine.kv_access import KVAccess
    from sgl_pic.engine.rotation import ModelRope
    from sgl_pic.keys import ModelFingerprint
    from sgl_pic.rope import default_inv_freq, rotate_layers
    from tests.support.fakes import FakePool

    layers, heads, dim, n = 2, 2, 8, 6
    inv_freq = default_inv_freq(dim, 10000.0)
    rope = ModelRope.plain(inv_freq, layout=layout)
    g = torch.Generator().manual_seed(0)
    k_true = torch.randn(layers, n, heads, dim, generator=g)
    v = torch.randn(layers, n, heads, dim, generator=g)
    post = rotate_layers(k_true, torch.arange(n), inv_freq, layout)  # as phase 1 leaves them
    k_pre = KVAccess(FakePool(64, layers, heads, dim), layers, rope).pre_rope_keys(
        torch.stack([post, v], dim=1)
    )
    settings = PicServerSettings(PicConfig(), host_cache_mb=4)
    fingerprint = ModelFingerprint(model_id="m", dtype="float32")
    lower = tier_setup.lower_tiers_of(settings, fingerprint, rope.spec)
    try:
        tokens = list(range(100, 100 + n))
        lower.put_chunk(tokens, k_pre, v, None)
        hit = lower.match(tokens)
        assert hit is not None
        full = lower.load_full(hit, tokens)
        assert full is not None
        torch.testing.assert_close(full[:, 0], post, atol=1e-5, rtol=1e-5)
    finally:
        lower.store.close()


def test_a_refused_server_gets_sglangs_own_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HiCache on (a combination chunk reuse refuses), the tree is the one SGLang's
    default factory builds, HiCache and all, not the sgl_pic tree; marks are ignored."""
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()  # the sgl_kernel / torchvision stand-ins SGLang's tree imports
    from sglang.srt.mem_cache import registry

    from tests.binding.test_model_hooks import ctx

    built: list[Any] = []
    monkeypatch.setattr(registry, "default_radix_cache_factory", lambda c: built.append(c) or c)
    # Prometheus names are global and other tests of this process register PicMetrics.
    refused: dict[str, float] = {}
    gauge = SimpleNamespace(
        labels=lambda reason: SimpleNamespace(set=lambda v: refused.__setitem__(reason, v))
    )
    monkeypatch.setattr(compose, "PicMetrics", lambda: SimpleNamespace(unsupported=gauge))
    previous = set_current(None)
    try:
        c = ctx("torch_native", enable_hierarchical_cache=True)
        c.model_config.vocab_size = 100
        assert plugin.build_tree_cache(c) is c and built == [c]
        rt = current()
        assert rt is not None and rt.executor is None and rt.gate.signer is None
        assert refused == {"kv_tiers": 1}
    finally:
        set_current(previous)


def test_batches_with_chunked_requests_are_kept_off_the_prefill_graph(
    runtime: PicRuntime,
) -> None:
    asked: list[Any] = []

    def can_run_graph(_runner: Any, fb: Any) -> bool:
        asked.append(fb)
        return True

    layout = PromptLayout.from_spans(6, [[0, 4]])
    runtime.marks.put("a", Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6)))
    runtime.prepare_batch(SimpleNamespace(reqs=[req("a", [1, 2, 3, 4, 5, 6])]))
    chunked = SimpleNamespace(rids=["x", "a"])
    plain = SimpleNamespace(rids=["x", "y"])
    assert hooks.prefill_graph_hook(can_run_graph, None, chunked) is False
    assert hooks.prefill_graph_hook(can_run_graph, None, plain) is True
    assert hooks.prefill_graph_hook(can_run_graph, None, SimpleNamespace(rids=None)) is False
    runtime.prepare_batch(SimpleNamespace(reqs=[]))
    assert hooks.prefill_graph_hook(can_run_graph, None, chunked) is True
    assert asked == [plain, chunked]  # SGLang decides every batch without chunked requests


def test_the_guard_is_seen_through_sglangs_hook_registry(
    monkeypatch: pytest.MonkeyPatch, runtime: PicRuntime
) -> None:
    """Applied by SGLang's real HookRegistry to its real runner class, the hook is found
    by ``model_hooks.graph_guarded`` and runs on the runner's ``can_run_graph``."""
    from collections import defaultdict

    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_pic.binding.model_hooks import graph_guarded

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    # Put back whatever the class had, once the test is done.
    monkeypatch.setattr(
        PrefillCudaGraphRunner, "can_run_graph", PrefillCudaGraphRunner.can_run_graph
    )
    runner = object.__new__(PrefillCudaGraphRunner)
    assert not graph_guarded(runner)
    HookRegistry.register(hooks.PREFILL_GRAPH_TARGET, hooks.prefill_graph_hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    assert graph_guarded(runner)
    layout = PromptLayout.from_spans(6, [[0, 4]])
    runtime.marks.put("a", Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6)))
    runtime.prepare_batch(SimpleNamespace(reqs=[req("a", [1, 2, 3, 4, 5, 6])]))
    assert runner.can_run_graph(SimpleNamespace(rids=["a"])) is False


def test_a_pool_paged_unlike_the_chunk_starts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang may resolve a page size the launcher did not pad chunk starts to; reuse is
    then refused (SGLang's own tree serves) with the flag that lifts it."""
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.mem_cache import registry

    from tests.binding.test_model_hooks import MHATokenToKVPool, ctx
    from tests.support.fakes import FakeAllocator

    built: list[Any] = []
    monkeypatch.setattr(registry, "default_radix_cache_factory", lambda c: built.append(c) or c)
    refused: dict[str, float] = {}
    gauge = SimpleNamespace(
        labels=lambda reason: SimpleNamespace(set=lambda v: refused.__setitem__(reason, v))
    )
    monkeypatch.setattr(compose, "PicMetrics", lambda: SimpleNamespace(unsupported=gauge))
    monkeypatch.delenv("SGLPIC_SETTINGS", raising=False)  # page size 1, the default
    previous = set_current(None)
    try:
        c = ctx("flashinfer")
        allocator = FakeAllocator(8, page_size=16)
        allocator.get_kvcache = MHATokenToKVPool  # type: ignore[attr-defined]
        c.params.token_to_kv_pool_allocator = allocator
        c.model_config.vocab_size = 100
        assert plugin.build_tree_cache(c) is c and built == [c]
        rt = current()
        assert refused == {"page_size": 1} and rt is not None and rt.executor is None
    finally:
        set_current(previous)


def test_kernels_are_prepared_once_at_start_up_for_a_cuda_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sgl_pic.ops import cuda

    calls: list[torch.device] = []
    monkeypatch.setattr(cuda, "prepare", lambda d: calls.append(d) or "ready", raising=False)
    assert compose.prepare_kernels(torch.device("cpu")) is None and calls == []
    assert compose.prepare_kernels(torch.device("cuda", 1)) == "ready"
    assert calls == [torch.device("cuda", 1)]


def test_per_namespace_caps_reach_the_host_and_disk_tiers(tmp_path: Any) -> None:
    """--pic-namespace-host-mb / --pic-namespace-disk-mb become the tiers' fair-share caps
    (0: none), as the server builds them."""
    from sgl_pic.binding.settings import PicServerSettings
    from sgl_pic.config import PicConfig
    from sgl_pic.engine.rotation import ModelRope
    from sgl_pic.keys import ModelFingerprint
    from sgl_pic.rope import default_inv_freq

    rope = ModelRope.plain(default_inv_freq(8, 10000.0))
    fingerprint = ModelFingerprint(model_id="m", dtype="float32")
    for host_mb, disk_mb in ((0, 0), (3, 5)):
        settings = PicServerSettings(
            PicConfig(),
            host_cache_mb=4,
            disk_cache_dir=str(tmp_path / f"d{disk_mb}"),
            namespace_host_mb=host_mb,
            namespace_disk_mb=disk_mb,
        )
        lower = tier_setup.lower_tiers_of(settings, fingerprint, rope.spec)
        try:
            assert lower.store.host.config.namespace_max_bytes == host_mb * 2**20
            assert lower.store.disk.config.namespace_max_bytes == disk_mb * 2**20
        finally:
            lower.store.close()
