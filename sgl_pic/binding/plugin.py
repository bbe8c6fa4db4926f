"""Registration with SGLang: the ``sgl_pic`` radix cache backend and the targeted hooks.

``register`` is the ``sglang.srt.plugins`` entry point; SGLang's ``load_plugins()`` calls it
in every process (scheduler included) and then applies the hooks. It is idempotent, so
``python -m sgl_pic.launch_server`` may also call it where no entry point is installed.

``build_tree_cache`` (the backend's factory) builds this scheduler process's
``PicRuntime``, the one owner of its state (``compose``); the hooks (``binding.hooks``)
pass straight through to SGLang unless it was built in that process, so installing the
plugin never changes a server that does not select it. One hook only reads the clock, in
every server (``forward_timer``: seconds in forwards by kind); one adds the drift signal
to OpenAI chat responses (``http.openai_meta``), only where this backend's scheduler put
it in ``meta_info``.
"""

from __future__ import annotations

from typing import Any

from sgl_pic.binding import hooks
from sgl_pic.binding.fingerprint import machine_digests
from sgl_pic.binding.forward_timer import FORWARD_TARGET, ForwardTimer
from sgl_pic.binding.settings import BACKEND_NAME
from sgl_pic.binding.weight_updates import WeightUpdateHook
from sgl_pic.http import openai_meta


def register() -> None:
    """Registers the backend and the hooks, once per process: a second call finds the
    backend registered and does nothing."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if get_radix_cache_factory(BACKEND_NAME) is not None:
        return
    register_radix_cache_backend(BACKEND_NAME, build_tree_cache)
    HookRegistry.register(
        hooks.TORCH_NATIVE_EXTEND, hooks.torch_native_extend_hook, HookType.AROUND
    )
    HookRegistry.register(hooks.PREPARE_TARGET, hooks.after_prepare_for_extend, HookType.AFTER)
    HookRegistry.register(hooks.ADMIT_TARGET, hooks.admit_hook, HookType.AROUND)
    # The registry holds the timer (and through it its counters): no module state.
    HookRegistry.register(FORWARD_TARGET, ForwardTimer().timed_forward, HookType.AROUND)
    HookRegistry.register(hooks.PREFILL_GRAPH_TARGET, hooks.prefill_graph_hook, HookType.AROUND)
    # The registry holds the factory (and through it the planned charges): no module state.
    HookRegistry.register(
        hooks.PREFILL_ADDER_TARGET, hooks.PrefillAdderFactory().hook, HookType.AROUND
    )
    HookRegistry.register(openai_meta.CHAT_TARGET, openai_meta.after_build_response, HookType.AFTER)
    # The registry holds the hook (and through it the digest cache): no module state.
    for target, hook in WeightUpdateHook(machine_digests()).targets().items():
        HookRegistry.register(target, hook, HookType.AFTER)


def build_tree_cache(ctx: Any) -> Any:
    """Radix cache factory: SGLang's own tree plus chunk nodes (``ChunkRadixCache``) and
    everything the chunk path needs under it, owned by the process's ``PicRuntime``
    (``compose``)."""
    from sgl_pic.binding.compose import compose

    return compose(ctx).cache
