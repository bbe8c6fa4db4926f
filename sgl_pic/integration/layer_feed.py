"""The per-layer transfer / recompute / forward pipeline inside SGLang's model forward.

SGLang's model runs its own layer loop, so the pipeline is pulled rather than driven: the
attention hook calls ``before_layer(l)`` as phase 2 reaches layer l, and gets layer l's
reused KV of lower-tier chunks written into the request's slots before attention reads
them. Meanwhile a transfer worker fetches later layers (sparse: only the complement of each
chunk's recomputed set) and rotates their keys to their global positions (deferred RoPE),
at most ``depth`` layers ahead of the forward, handing each layer over through an event.
That is CacheTune Appendix B's schedule: transfer of l + 1 overlaps the forward of l.

Modes: "threaded" (a worker thread; the CPU default) and "inorder" (fetched on demand, the
reference order). On a GPU the same worker would issue its copies on a side CUDA stream
and hand over with CUDA events; that variant is in ``sgl_pic.store.pipeline`` and has not
run here (no GPU was available), so the engine uses the threaded schedule everywhere.

Waits are bounded: a layer not loaded within ``timeout_s`` raises ``FeedTimeout`` and stops
the worker. Only the forward's thread writes the pool (in ``before_layer``), so a stuck or
late worker never touches the request's slots; the batch's exact rerun overwrites them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from sgl_pic.integration.kv_access import KVAccess
from sgl_pic.store.loader import ChunkPlacement, LoadedLayer, SparseLoader

logger = logging.getLogger(__name__)

FEED_MODES: tuple[str, ...] = ("threaded", "inorder")
# Longest wait in ``close`` for the worker to end. It stops at its next step; one stuck in
# a read ends by itself when the read returns (and writes nothing), so the forward's
# thread does not wait out a stuck read a second time.
CLOSE_WAIT_S = 2.0


class MissingChunkError(RuntimeError):
    """A lower-tier record vanished or failed its checks while loading: the request cannot
    use it (the store has counted and dropped it)."""


class FeedTimeout(RuntimeError):
    """A layer's reused KV was not loaded within the feed's ``timeout_s`` (a stuck read).
    The worker has been told to stop; the pool holds the layers written before it (and
    nothing else the feed wrote), which an exact rerun of the batch overwrites."""


class LayerFeed:
    """Loads the reused KV of one request's lower-tier chunks into its pool slots.

    slots:     # [prompt_len] int64 the request's pool slots, indexed by global position.
    timeout_s: longest wait of ``before_layer`` for one layer in "threaded" mode (then
               ``FeedTimeout``). "inorder" loads on the caller's thread, unbounded.
    """

    def __init__(
        self,
        loader: SparseLoader,
        placements: Sequence[ChunkPlacement],
        slots: torch.Tensor,
        kv: KVAccess,
        num_layers: int,
        mode: str = "threaded",
        depth: int = 2,
        timeout_s: float = 120.0,
    ) -> None:
        if mode not in FEED_MODES:
            raise ValueError(f"unknown feed mode {mode!r}; valid: {', '.join(FEED_MODES)}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.loader = loader
        self.placements = list(placements)
        self.slots = slots
        self.kv = kv
        self.num_layers = num_layers
        self.mode = mode
        self.depth = depth
        self.timeout_s = timeout_s
        self.bytes_moved = 0
        self.bytes_dense = 0
        self.tokens_moved = 0
        self._loaded: dict[int, LoadedLayer] = {}
        self._ready = [threading.Event() for _ in range(num_layers)]
        self._consumed = threading.Semaphore(depth)
        self._error: BaseException | None = None
        self._next = 0  # next layer the forward will consume
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.mode == "threaded" and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sgl-pic-feed", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for layer in range(self.num_layers):
                # At most ``depth`` layers fetched and not yet consumed.
                while not self._consumed.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                loaded = self._load(layer)
                if self._stop.is_set():
                    return  # timed out or closed meanwhile: nobody will consume it
                self._loaded[layer] = loaded
                self._ready[layer].set()
        except BaseException as e:  # noqa: BLE001 - handed to the forward thread
            self._error = e
            for ev in self._ready:
                ev.set()

    def _load(self, layer: int) -> LoadedLayer:
        loaded = self.loader.rotate(self.loader.fetch_layer(self.placements, layer))
        if loaded.missing:
            raise MissingChunkError(
                f"{len(loaded.missing)} lower-tier segment(s) became unreadable at layer {layer}"
            )
        return loaded

    def before_layer(self, layer: int) -> None:
        """Blocks until layer ``layer``'s reused KV is in the pool (writing it there)."""
        if layer != self._next:
            raise RuntimeError(f"feed expected layer {self._next}, the forward is at {layer}")
        if self.mode == "inorder":
            loaded = self._load(layer)
        else:
            if not self._ready[layer].wait(self.timeout_s):
                # Stop the worker now, even if the caller never closes the feed.
                self._stop.set()
                raise FeedTimeout(f"layer {layer}'s reused KV not loaded in {self.timeout_s:g} s")
            if self._error is not None:
                raise self._error
            loaded = self._loaded.pop(layer)
            self._consumed.release()
        if loaded.positions.numel():
            self.kv.write_layer(layer, self.slots[loaded.positions], loaded.k, loaded.v)
        self.bytes_moved += loaded.bytes_moved
        self.bytes_dense += loaded.bytes_dense
        self.tokens_moved += int(loaded.positions.numel())
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next == self.num_layers

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread still runs (after ``close``: stuck in a read that has
        not returned yet; it ends when it does, writing nothing)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stops the worker (after an error, a timeout or a completed forward) and waits
        for it at most ``CLOSE_WAIT_S``. The pool is not touched after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=min(self.timeout_s, CLOSE_WAIT_S))
            if self._thread.is_alive():
                logger.warning(
                    "sgl_pic: a layer feed's worker is still in a read; it ends when the "
                    "read returns"
                )
            else:
                self._thread = None
        self._loaded.clear()
