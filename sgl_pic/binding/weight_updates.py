"""Weight updates re-key the chunk cache: nothing computed under the old weights is served
after SGLang's update call returns.

SGLang's scheduler changes the served weights only through its
``SchedulerWeightUpdaterManager`` (``scheduler_components/weight_updater.py``): from disk,
from tensors, from a distributed group, over IPC, and between ``begin_weight_update`` and
``end_weight_update`` (where P2P/RDMA writes may land with no call of ours). Its flush
(``flush_cache`` on the request, on by default) clears the device tree only, and may be
refused or skipped; the host, disk and shared tiers keep KV keyed by the old weights. So an
AFTER hook on each of those methods re-keys every tier (``PicRuntime.weights_changed``),
whatever the call reported: a failed update may have loaded part of the weights.

The new key: from disk, the identity of the files loaded (``model_identity``), so a server
updated to a checkpoint keys chunks as one launched from it; otherwise, and where that
identity cannot be taken, a random name nobody else has. LoRA adapters need
``--enable-lora``, which turns reuse off (``self_check``).
"""

from __future__ import annotations

import logging
import secrets
from types import MappingProxyType
from typing import Any

from sgl_pic.binding.runtime import current
from sgl_pic.file_digests import FileDigests
from sgl_pic.model_identity import ModelIdentityError, model_identity

logger = logging.getLogger(__name__)

MANAGER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
# The manager's methods after which the served weights may differ, by source label.
SOURCES = MappingProxyType(
    {
        "update_weights_from_disk": "disk",
        "update_weights_from_tensor": "tensor",
        "update_weights_from_distributed": "distributed",
        "update_weights_from_ipc": "ipc",
        "begin_weight_update": "session",
        "end_weight_update": "session",
    }
)


class WeightUpdateHook:
    """Scheduler side: the AFTER hook SGLang's HookRegistry calls after each method in
    ``SOURCES`` (the registry holds it; ``digests`` caches weight-file digests)."""

    def __init__(self, digests: FileDigests) -> None:
        self.digests = digests

    def targets(self) -> dict[str, Any]:
        """Hook target -> callable, one per method of ``SOURCES``."""
        return {f"{MANAGER}.{name}": self._after(name) for name in SOURCES}

    def new_identity(self, method: str, recv_req: Any) -> str:
        """The key under which chunks of the weights ``method`` left are stored."""
        if method == "update_weights_from_disk":
            try:
                return model_identity(
                    str(recv_req.model_path),
                    self.digests,
                    load_format=str(getattr(recv_req, "load_format", None) or "auto"),
                )
            except ModelIdentityError as e:
                logger.warning("sgl_pic: updated weights keyed by a random name: %s", e)
        return "unnamed-weights-" + secrets.token_hex(16)

    def _after(self, method: str) -> Any:
        def hook(result: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
            runtime = current()
            if runtime is not None:
                recv_req = args[0] if args else kwargs.get("recv_req")
                runtime.weights_changed(SOURCES[method], self.new_identity(method, recv_req))
            return result

        hook.__qualname__ = f"WeightUpdateHook.after_{method}"
        return hook
