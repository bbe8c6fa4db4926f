"""Weight updates re-key every chunk tier: the hooks sit on the methods SGLang's scheduler
changes weights through, and see the request SGLang hands them."""

from __future__ import annotations

import inspect
import pkgutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from sgl_pic.binding import runtime as runtime_mod
from sgl_pic.binding.weight_updates import MANAGER, SOURCES, WeightUpdateHook
from sgl_pic.file_digests import FileDigests
from sgl_pic.model_identity import model_identity

pytestmark = pytest.mark.sglang


class Recorder:
    """Stands in for ``PicRuntime``: records what ``weights_changed`` was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def weights_changed(self, source: str, model_id: str) -> None:
        self.calls.append((source, model_id))


@pytest.fixture()
def recorder() -> Any:
    rec = Recorder()
    previous = runtime_mod.set_current(rec)  # type: ignore[arg-type]
    yield rec
    runtime_mod.set_current(previous)


@pytest.fixture()
def manager_cls() -> Any:
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    return pkgutil.resolve_name(MANAGER)


def weights(root: Path, data: bytes) -> Path:
    root.mkdir()
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(data)
    return root


def test_every_target_is_a_method_of_sglangs_manager_taking_the_request(manager_cls: Any) -> None:
    for name in SOURCES:
        params = list(inspect.signature(getattr(manager_cls, name)).parameters)
        assert params == ["self", "recv_req"], (name, params)
    # Every method of the manager that loads weights is covered.
    loaders = {n for n in vars(manager_cls) if n.startswith("update_weights_from_")}
    assert loaders <= set(SOURCES)


def test_sglangs_update_from_disk_rekeys_by_the_loaded_files(
    manager_cls: Any, recorder: Recorder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SGLang's real registry wraps its real manager; the real ``update_weights_from_disk``
    runs (its runner and scheduler stand in) and the hook gets its request."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    for name in SOURCES:  # monkeypatch puts SGLang's methods back after the test
        monkeypatch.setattr(manager_cls, name, getattr(manager_cls, name))
    hook = WeightUpdateHook(FileDigests(tmp_path / "digests"))
    for target, fn in hook.targets().items():
        HookRegistry.register(target, fn, HookType.AFTER)
    HookRegistry.apply_hooks()

    class Updater:
        def update_weights_from_disk(self, *a: Any, **kw: Any) -> tuple[bool, str]:
            return True, "loaded"

    runner = type("Runner", (), {"weight_updater": Updater()})()
    manager = object.__new__(manager_cls)  # its __post_init__ needs a process group
    manager.tp_worker = type(
        "W", (), {"weight_update_runners": lambda self: [("target", runner)]}
    )()
    manager.draft_worker = None
    manager.flush_cache = lambda **kw: True
    manager.metrics_collector = None
    manager.scheduler = type("S", (), {"record_weight_version_change": lambda self, **kw: None})()

    new = weights(tmp_path / "new", b"\x07" * 100)
    out = manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=str(new)))
    assert out.success
    assert recorder.calls == [("disk", model_identity(str(new), FileDigests(None)))]


def test_anonymous_updates_get_a_name_nobody_else_has(tmp_path: Path) -> None:
    hook = WeightUpdateHook(FileDigests(None))
    names = {hook.new_identity("update_weights_from_tensor", None) for _ in range(3)}
    assert len(names) == 3
    # Disk weights that cannot be named (random, or gone) are anonymous too.
    req = type("R", (), {"model_path": str(tmp_path / "gone"), "load_format": None})()
    assert hook.new_identity("update_weights_from_disk", req).startswith("unnamed-weights-")
    new = weights(tmp_path / "w", b"\x01")
    req = type("R", (), {"model_path": str(new), "load_format": "dummy"})()
    assert hook.new_identity("update_weights_from_disk", req).startswith("unnamed-weights-")


def test_the_hook_passes_sglangs_result_through_and_rekeys_even_after_a_failure(
    recorder: Recorder,
) -> None:
    hook = WeightUpdateHook(FileDigests(None))
    fn = hook.targets()[f"{MANAGER}.update_weights_from_tensor"]
    result = object()
    assert fn(result, object(), None) is result
    assert fn(result, object(), recv_req=None) is result
    assert [s for s, _ in recorder.calls] == ["tensor", "tensor"]


def test_without_a_runtime_nothing_happens() -> None:
    previous = runtime_mod.set_current(None)
    try:
        fn = WeightUpdateHook(FileDigests(None)).targets()[f"{MANAGER}.end_weight_update"]
        assert fn("r", object(), None) == "r"
    finally:
        runtime_mod.set_current(previous)
