"""The per-layer transfer / recompute / forward pipeline inside SGLang's model forward.

SGLang's model runs its own layer loop, so the pipeline is pulled rather than driven: the
attention hook calls ``before_layer(l)`` as phase 2 reaches layer l, and gets layer l's
reused KV of lower-tier chunks written into the request's slots before attention reads
them. Meanwhile a transfer worker fetches later layers (sparse: only the complement of each
chunk's recomputed set) and rotates their keys to their global positions (deferred RoPE),
at most ``depth`` layers ahead of the forward, handing each layer over through an event.
That is CacheTune Appendix B's schedule: transfer of l + 1 overlaps the forward of l.

Modes: "threaded" (a worker thread) and "inorder" (fetched on demand on the forward's
thread and stream, the reference order).

With the pool on a CUDA device, "threaded" is the three-stream schedule: the worker
reads rows on the host, stages them in pinned memory and issues the host-to-device copy
and the key rotation on a side CUDA stream, then records that layer's CUDA event. The
threading.Event still says "issued"; ``before_layer(l)`` makes the forward's current
stream wait on event l (a device-side wait, no host sync) and then scatters the rows into
the pool on that stream, so the copy of layer l + 1 overlaps the compute of layer l. On a
CPU pool the threading.Event alone orders everything and the handoff is a no-op
(``HostHandoff``); ``CudaHandoff`` is the CUDA one.

A record that is gone or fails its checks while loading (``SparseLoader.fetch_layer``'s
``missing``: the store has counted and dropped it) does not stop the forward: its rows are
left as they are, every other chunk is still loaded, and the feed lists it in ``missing``.
Raising in the middle of a forward on one tensor-parallel rank would leave the others
waiting in its collectives; instead the executor asks every rank after phase 2 whether any
of its feeds missed a record (``RankAgreement.any_of``), and all of them retry the batch,
or fall back, together.

Waits are bounded: a layer not loaded within ``timeout_s`` stops the worker and sets
``timed_out``; nothing more is loaded, and the executor agrees on it with the other ranks
after the forward (all of them then run the batch as exact prefill). Only the forward's
thread writes the pool (in ``before_layer``), so a stuck or late worker never touches the
request's slots; the batch's exact rerun overwrites them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.store.loader import ChunkPlacement, FetchedLayer, LoadedLayer, SparseLoader
from sgl_pic.worker_threads import start_thread

logger = logging.getLogger(__name__)

FEED_MODES: tuple[str, ...] = ("threaded", "inorder")
# Longest wait in ``close`` for the worker to end. It stops at its next step; one stuck in
# a read ends by itself when the read returns (and writes nothing), so the forward's
# thread does not wait out a stuck read a second time.
CLOSE_WAIT_S = 2.0
# The side stream's priority: lower is higher in CUDA, and torch maps any value below its
# range to the highest. A layer's copy is what the next layer's forward waits on, so it
# should not queue behind the forward's own kernels.
SIDE_STREAM_PRIORITY = -1
# Draws from torch's stream pool before giving up on a stream distinct from the current
# one (the pool hands out a few dozen streams per priority, round robin).
SIDE_STREAM_DRAWS = 65


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A high-priority CUDA stream on ``device`` that is not the current (forward) stream.

    torch's ``Stream()`` hands out pool streams round robin, so a fresh one may alias a
    stream already in use, the forward's own included; copies issued on the forward's
    stream would then serialise with it and the event wait would order nothing. Called on
    the forward's thread (the layer feed is built there)."""
    current = torch.cuda.current_stream(device)
    for _ in range(SIDE_STREAM_DRAWS):
        stream = torch.cuda.Stream(device=device, priority=SIDE_STREAM_PRIORITY)
        if stream.cuda_stream != current.cuda_stream:
            return stream
    raise RuntimeError(
        f"no CUDA stream distinct from the current one in {SIDE_STREAM_DRAWS} draws on {device}"
    )


class MissingChunkError(RuntimeError):
    """A lower-tier record vanished or failed its checks while loading (on this rank or,
    with tensor parallelism, on another): the request cannot use it (the store that held
    it has counted and dropped it). Raised outside forwards only (``feed_every_layer``,
    the executor after phase 2)."""


class FeedTimeout(RuntimeError):
    """A layer's reused KV was not loaded within the feed's ``timeout_s`` (a stuck read).
    The worker has been told to stop; the pool holds the layers written before it (and
    nothing else the feed wrote), which an exact rerun of the batch overwrites."""


class HostHandoff:
    """Handoff of a loaded layer from the worker to the forward when the pool is on the
    CPU: the worker's tensors are complete when it sets the layer's threading.Event, so
    there is nothing more to order. ``CudaHandoff`` is the device variant."""

    def issuing(self) -> AbstractContextManager[object]:
        """Context the worker loads a layer in."""
        return nullcontext()

    def to_pool_device(self, fetched: FetchedLayer) -> FetchedLayer:
        """The fetched rows where the pool is (here: as fetched)."""
        return fetched

    def record(self, layer: int) -> None:
        """Worker, after issuing layer ``layer``'s copies and rotation."""

    def wait(self, layer: int) -> None:
        """Forward thread, before writing layer ``layer`` into the pool."""

    def retire(self, loaded: LoadedLayer) -> None:
        """Forward thread, after the pool write that consumed ``loaded``."""


class CudaHandoff(HostHandoff):
    """Side-stream copies with one CUDA event per layer.

    The worker's copies and rotation go on ``stream`` (``side_stream``: never the
    forward's); ``record(l)`` marks their end with
    ``events[l]``; ``wait(l)`` makes the forward's current stream wait for it on the
    device. The rows were allocated on the side stream and are read on the forward's, so
    ``retire`` tells the caching allocator (``record_stream``) not to reuse them before
    that read is done.
    """

    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.stream = side_stream(device)
        self.events = [torch.cuda.Event() for _ in range(num_layers)]

    def issuing(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.stream)

    def to_pool_device(self, fetched: FetchedLayer) -> FetchedLayer:
        # Rows still on the host go through pinned staging, so the copy is asynchronous
        # on the side stream (a pageable source would make it a host-synchronous copy).
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == self.device:
                return t
            staged = t if t.is_pinned() else t.pin_memory()
            return staged.to(self.device, non_blocking=True)

        if fetched.positions.numel() == 0:
            return fetched
        return dataclasses.replace(fetched, k=move(fetched.k), v=move(fetched.v))

    def record(self, layer: int) -> None:
        self.events[layer].record(self.stream)

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def retire(self, loaded: LoadedLayer) -> None:
        current = torch.cuda.current_stream(self.device)
        for t in (loaded.k, loaded.v):
            if t.device.type == "cuda":
                t.record_stream(current)


def pool_device(kv: KVAccess) -> torch.device:
    """Where the pool's layer-0 key buffer lives."""
    return kv.pool.get_key_buffer(0).device


def make_handoff(device: torch.device, num_layers: int) -> HostHandoff:
    """The handoff for a pool on ``device``: CUDA events for a CUDA pool, else none."""
    if device.type == "cuda":
        return CudaHandoff(device, num_layers)
    return HostHandoff()


class LayerFeed:
    """Loads the reused KV of one request's lower-tier chunks into its pool slots.

    slots:     # [prompt_len] int64 the request's pool slots, indexed by global position.
    timeout_s: longest wait of ``before_layer`` for one layer in "threaded" mode (then
               ``FeedTimeout``). "inorder" loads on the caller's thread, unbounded.

    ``missing``: the keys of records that could not be read at some layer (never written
    from then on); read it once the feed is closed.

    On a CUDA pool, "threaded" copies on a side stream (``CudaHandoff``); after
    ``before_layer(l)`` returns, layer l is ordered before any later work on the caller's
    current stream (not necessarily finished on the device yet).
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
        self.missing: list[str] = []
        self.timed_out = False  # a layer was not loaded in time (the rest were skipped)
        self.failed = False  # the worker raised (the rest were skipped)
        self._loaded: dict[int, LoadedLayer] = {}
        self._ready = [threading.Event() for _ in range(num_layers)]
        self._consumed = threading.Semaphore(depth)
        self._error: BaseException | None = None
        self._next = 0  # next layer the forward will consume
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # "inorder" loads on the forward's own stream: nothing to hand over.
        self._handoff = (
            make_handoff(pool_device(kv), num_layers) if mode == "threaded" else HostHandoff()
        )

    def start(self) -> None:
        if self.mode == "threaded" and self._thread is None:
            self._thread = start_thread(self._run, "sgl-pic-feed")

    def _run(self) -> None:
        try:
            for layer in range(self.num_layers):
                # At most ``depth`` layers fetched and not yet consumed.
                while not self._consumed.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                with self._handoff.issuing():
                    loaded = self._load(layer)
                    self._handoff.record(layer)
                if self._stop.is_set():
                    return  # timed out or closed meanwhile: nobody will consume it
                self._loaded[layer] = loaded
                self._ready[layer].set()
        except BaseException as e:  # noqa: BLE001 - handed to the forward thread
            self._error = e
            for ev in self._ready:
                ev.set()

    def _load(self, layer: int) -> LoadedLayer:
        """Layer ``layer`` of every readable record; one that is not is listed in
        ``missing`` and left out (on the worker, or the forward's thread in "inorder")."""
        fetched = self.loader.fetch_layer(self.placements, layer)
        for key in fetched.missing:
            if key not in self.missing:
                logger.warning("sgl_pic: lower-tier record %s unreadable at layer %d", key, layer)
                self.missing.append(key)
        return self.loader.rotate(self._handoff.to_pool_device(fetched))

    def before_layer(self, layer: int) -> None:
        """Blocks until layer ``layer``'s reused KV is in the pool (writing it there)."""
        if layer != self._next:
            raise RuntimeError(f"feed expected layer {self._next}, the forward is at {layer}")
        if self.gave_up:
            self._next += 1  # nothing more is loaded: the batch is given up (``gave_up``)
            return
        if self.mode == "inorder":
            loaded = self._load(layer)
        else:
            if not self._ready[layer].wait(self.timeout_s):
                # Stop the worker now, even if the caller never closes the feed. Not raised
                # mid-forward: other tensor-parallel ranks are in this forward's collectives;
                # the executor agrees on it with them after the forward.
                self._stop.set()
                self.timed_out = True
                logger.warning(
                    "sgl_pic: layer %d's reused KV not loaded in %g s", layer, self.timeout_s
                )
                self._next += 1
                return
            if self._error is not None:
                # As a timeout: not raised mid-forward; the feed gives up and the executor
                # agrees on it with the other ranks after the forward.
                logger.warning("sgl_pic: the layer feed failed: %r", self._error)
                self._stop.set()
                self.failed = True
                self._next += 1
                return
            loaded = self._loaded.pop(layer)
            self._consumed.release()
            self._handoff.wait(layer)
        if loaded.positions.numel():
            self.kv.write_layer(layer, self.slots[loaded.positions], loaded.k, loaded.v)
            self._handoff.retire(loaded)
        self.bytes_moved += loaded.bytes_moved
        self.bytes_dense += loaded.bytes_dense
        self.tokens_moved += int(loaded.positions.numel())
        self._next += 1

    @property
    def gave_up(self) -> bool:
        """Whether a layer timed out or the worker failed: nothing more is loaded."""
        return self.timed_out or self.failed

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


def feed_every_layer(feed: LayerFeed) -> None:
    """Starts ``feed`` and asks it for each layer in order, as a forward's layer hooks
    do, with no forward in between (calibration times the feed's own handoffs this way);
    the feed is closed whatever happens. ``MissingChunkError`` once every layer was asked
    for, if a record could not be read (no forward runs here, so raising stalls no other
    rank)."""
    feed.start()
    try:
        for layer in range(feed.num_layers):
            feed.before_layer(layer)
    finally:
        feed.close()
    if feed.failed and feed._error is not None:
        raise feed._error
    if feed.timed_out:
        raise FeedTimeout(f"a layer's reused KV was not loaded in {feed.timeout_s:g} s")
    if feed.missing:
        raise MissingChunkError(f"{len(feed.missing)} lower-tier segment(s) became unreadable")
