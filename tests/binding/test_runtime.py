"""``PicRuntime``'s ownership contracts, read from the source (no SGLang needed): the
serving path keeps no module-level mutable state but the one process-level reference to
the runtime, and every hook SGLang calls is documented by the side that calls it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from sgl_pic.binding import hooks, runtime

ROOT = Path(__file__).resolve().parents[2]
SERVING = [
    *sorted((ROOT / "sgl_pic" / "engine").glob("*.py")),
    *sorted((ROOT / "sgl_pic" / "core").glob("*.py")),
    *(
        ROOT / "sgl_pic" / "binding" / f"{name}.py"
        for name in (
            "plugin",
            "compose",
            "tier_setup",
            "phases",
            "model_hooks",
            "forward_timer",
            "radix_cache",
            "lifecycle",
            "runtime",
            "hooks",
            "weight_updates",
        )
    ),
]


def test_one_process_level_reference_and_no_other_global_state() -> None:
    writes = []
    for path in SERVING:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                writes.append((path.name, tuple(node.names)))
    assert writes == [("runtime.py", ("_current",))]


def test_the_reference_is_set_and_put_back() -> None:
    marker = object()
    previous = runtime.set_current(marker)  # type: ignore[arg-type]
    try:
        assert runtime.current() is marker
    finally:
        assert runtime.set_current(previous) is marker
    assert runtime.current() is previous


def test_every_hook_and_runtime_method_names_its_side() -> None:
    for fn in (
        hooks.admit_hook,
        hooks.after_prepare_for_extend,
        hooks.torch_native_extend_hook,
        hooks.prefill_graph_hook,
    ):
        assert (fn.__doc__ or "").startswith(("Scheduler side", "Worker side")), fn.__name__
    public = [
        name
        for name, member in inspect.getmembers(runtime.PicRuntime, inspect.isfunction)
        if not name.startswith("_") and name != "close"
    ]
    assert sorted(public) == [
        "admit",
        "keeps_off_prefill_graph",
        "on_bypass",
        "on_extend",
        "on_logits",
        "prepare_batch",
        "request_done",
        "runs_phase",
        "torch_native_extend",
        "weights_changed",
    ]
    for name in public:
        doc = getattr(runtime.PicRuntime, name).__doc__ or ""
        assert doc.startswith(("Scheduler side", "Worker side")), name


def test_a_weight_update_rekeys_the_executor_and_is_counted() -> None:
    from types import SimpleNamespace

    rekeyed: list[str] = []
    counted: list[str] = []
    counter = SimpleNamespace(inc=lambda: None)
    metrics = SimpleNamespace(
        weight_updates=SimpleNamespace(labels=lambda source: counted.append(source) or counter)
    )
    executor = SimpleNamespace(rekey=rekeyed.append)
    gate = SimpleNamespace(marks=None)
    runtime.PicRuntime(gate, metrics, executor, None).weights_changed("disk", "abc")  # type: ignore[arg-type]
    assert rekeyed == ["abc"] and counted == ["disk"]
    # Reuse off in this process: counted, nothing to re-key.
    runtime.PicRuntime(gate, metrics).weights_changed("tensor", "def")  # type: ignore[arg-type]
    assert rekeyed == ["abc"] and counted == ["disk", "tensor"]
