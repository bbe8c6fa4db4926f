"""The plugin's scheduler hooks on stand-ins (SGLang importable, no server): a failing or
stalled chunk path falls back to SGLang's own forward; the hand-off is per batch, by
request id, and checked against token ids."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_pic.binding import plugin
from sgl_pic.binding.gate import PENDING_ATTR, Pending
from sgl_pic.engine.layer_feed import FeedTimeout
from sgl_pic.http.spans import PicRequest
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
        self.handoff: dict[str, Pending] = {}
        self.metrics = SimpleNamespace(failures=Counter(), marks_ignored=Counter())

    def forward(self, *_args: Any) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return torch.ones(2, 4)


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeExecutor]:
    ex = FakeExecutor(FeedTimeout("layer 3 not loaded in 0.1 s"))
    monkeypatch.setattr(plugin, "_executor", ex)
    monkeypatch.setattr(plugin, "_phases", FakePhases())
    yield ex


class FakePhases:
    """The phase runner as ``_on_extend`` sees it: no phase batch running."""

    def __init__(self) -> None:
        self.batch = None
        self.before_layer = [print]
        self.after_layer = [print]
        self.planned: list[Any] = []
        self.backend = SimpleNamespace(init_forward_metadata=self.planned.append)


def forward_batch() -> Any:
    return SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend=lambda: True),
        extend_prefix_lens_cpu=[0],
    )


def test_a_stalled_feed_runs_the_batch_as_sglang_would(executor: FakeExecutor) -> None:
    fb = forward_batch()
    out = plugin._on_extend(None, torch.tensor([1, 2]), torch.tensor([0, 1]), fb)
    # None: the stack runs the live batch itself, with the backend planned for it again
    # and no phase callbacks left behind.
    assert out is None and executor.metrics.failures.n == 1
    phases = plugin._phases
    assert phases.planned == [fb] and phases.before_layer == [] == phases.after_layer


def test_extend_batches_reach_the_executor_unless_a_phase_runs(
    executor: FakeExecutor,
) -> None:
    executor.error = None
    out = plugin._on_extend(None, torch.tensor([1, 2]), torch.tensor([0, 1]), forward_batch())
    assert out is not None and torch.equal(out, torch.ones(2, 4))
    plugin._phases.batch = object()  # a phase forward re-enters the stack: never nested
    assert plugin._on_extend(None, torch.tensor([1]), torch.tensor([0]), forward_batch()) is None


def req(rid: str, ids: list[int], pending: Pending | None) -> Any:
    r = SimpleNamespace(rid=rid, origin_input_ids=ids)
    if pending is not None:
        setattr(r, PENDING_ATTR, pending)
    return r


def test_hand_off_is_per_batch_by_request_id_and_token_checked(executor: FakeExecutor) -> None:
    layout = PromptLayout.from_spans(6, [[0, 4]])
    good = Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6))
    changed = Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6))
    executor.handoff = {"stale": good}  # an earlier batch's, never forwarded
    batch = SimpleNamespace(
        reqs=[
            req("a", [1, 2, 3, 4, 5, 6], good),
            req("b", [1, 2, 3, 4, 5, 7], changed),
            req("c", [9, 9], None),
        ]
    )
    plugin._after_prepare_for_extend(None, batch)
    assert executor.handoff == {"a": good}
    assert executor.metrics.marks_ignored.n == 1


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_lower_tiers_rotate_keys_by_the_models_own_pairing(layout: str) -> None:
    # Phase 1 stores keys un-rotated by the model's pairing; a tier that rotates them back
    # by another pairing would hand every later request (and the chunk nodes promoted from
    # it) wrong keys.
    from sgl_pic.binding.model_rope import ModelRope
    from sgl_pic.binding.settings import PicServerSettings
    from sgl_pic.config import PicConfig
    from sgl_pic.engine.kv_access import KVAccess
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
    lower = plugin.lower_tiers_of(settings, fingerprint, rope.spec)
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

    from sgl_pic.binding import metrics
    from tests.binding.test_model_hooks import ctx

    built: list[Any] = []
    monkeypatch.setattr(registry, "default_radix_cache_factory", lambda c: built.append(c) or c)
    # Prometheus names are global and other tests of this process register PicMetrics.
    refused: dict[str, float] = {}
    gauge = SimpleNamespace(
        labels=lambda reason: SimpleNamespace(set=lambda v: refused.__setitem__(reason, v))
    )
    monkeypatch.setattr(metrics, "PicMetrics", lambda: SimpleNamespace(unsupported=gauge))
    monkeypatch.setattr(plugin, "_gate", None)
    monkeypatch.setattr(plugin, "_executor", None)
    c = ctx("torch_native", enable_hierarchical_cache=True)
    c.model_config.vocab_size = 100
    assert plugin.build_tree_cache(c) is c and built == [c]
    assert plugin._executor is None and plugin._gate is not None
    assert plugin._gate.signer is None and refused == {"kv_tiers": 1}


def test_batches_with_chunked_requests_are_kept_off_the_prefill_graph(
    executor: FakeExecutor,
) -> None:
    asked: list[Any] = []

    def can_run_graph(_runner: Any, fb: Any) -> bool:
        asked.append(fb)
        return True

    layout = PromptLayout.from_spans(6, [[0, 4]])
    executor.handoff = {"a": Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6))}
    chunked = SimpleNamespace(rids=["x", "a"])
    plain = SimpleNamespace(rids=["x", "y"])
    assert plugin._prefill_graph_hook(can_run_graph, None, chunked) is False
    assert plugin._prefill_graph_hook(can_run_graph, None, plain) is True
    assert plugin._prefill_graph_hook(can_run_graph, None, SimpleNamespace(rids=None)) is False
    executor.handoff = {}
    assert plugin._prefill_graph_hook(can_run_graph, None, chunked) is True
    assert asked == [plain, chunked]  # SGLang decides every batch without chunked requests


def test_the_guard_is_seen_through_sglangs_hook_registry(monkeypatch: pytest.MonkeyPatch) -> None:
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
    HookRegistry.register(plugin.PREFILL_GRAPH_TARGET, plugin._prefill_graph_hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    assert graph_guarded(runner)
    layout = PromptLayout.from_spans(6, [[0, 4]])
    ex = FakeExecutor()
    ex.handoff = {"a": Pending(PicRequest(layout, {}), (1, 2, 3, 4, 5, 6))}
    monkeypatch.setattr(plugin, "_executor", ex)
    assert runner.can_run_graph(SimpleNamespace(rids=["a"])) is False


def test_a_pool_paged_unlike_the_chunk_starts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang may resolve a page size the launcher did not pad chunk starts to; reuse is
    then refused (SGLang's own tree serves) with the flag that lifts it."""
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.mem_cache import registry

    from sgl_pic.binding import metrics
    from tests.binding.test_model_hooks import MHATokenToKVPool, ctx
    from tests.support.fakes import FakeAllocator

    built: list[Any] = []
    monkeypatch.setattr(registry, "default_radix_cache_factory", lambda c: built.append(c) or c)
    refused: dict[str, float] = {}
    gauge = SimpleNamespace(
        labels=lambda reason: SimpleNamespace(set=lambda v: refused.__setitem__(reason, v))
    )
    monkeypatch.setattr(metrics, "PicMetrics", lambda: SimpleNamespace(unsupported=gauge))
    monkeypatch.setattr(plugin, "_gate", None)
    monkeypatch.setattr(plugin, "_executor", None)
    monkeypatch.delenv("SGLPIC_SETTINGS", raising=False)  # page size 1, the default
    c = ctx("flashinfer")
    allocator = FakeAllocator(8, page_size=16)
    allocator.get_kvcache = MHATokenToKVPool  # type: ignore[attr-defined]
    c.params.token_to_kv_pool_allocator = allocator
    c.model_config.vocab_size = 100
    assert plugin.build_tree_cache(c) is c and built == [c]
    assert refused == {"page_size": 1} and plugin._executor is None


def test_kernels_are_prepared_once_at_start_up_for_a_cuda_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sgl_pic.ops import cuda

    calls: list[torch.device] = []
    monkeypatch.setattr(cuda, "prepare", lambda d: calls.append(d) or "ready", raising=False)
    assert plugin.prepare_kernels(torch.device("cpu")) is None and calls == []
    assert plugin.prepare_kernels(torch.device("cuda", 1)) == "ready"
    assert calls == [torch.device("cuda", 1)]


def test_per_namespace_caps_reach_the_host_and_disk_tiers(tmp_path: Any) -> None:
    """--pic-namespace-host-mb / --pic-namespace-disk-mb become the tiers' fair-share caps
    (0: none), as the server builds them."""
    from sgl_pic.binding.model_rope import ModelRope
    from sgl_pic.binding.settings import PicServerSettings
    from sgl_pic.config import PicConfig
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
        lower = plugin.lower_tiers_of(settings, fingerprint, rope.spec)
        try:
            assert lower.store.host.config.namespace_max_bytes == host_mb * 2**20
            assert lower.store.disk.config.namespace_max_bytes == disk_mb * 2**20
        finally:
            lower.store.close()
