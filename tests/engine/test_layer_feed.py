"""LayerFeed: per-layer sparse loading of lower-tier chunk KV into (fake) pool slots.

The records are real: written with ``LowerTiers.put_chunk`` into a host + disk
``TieredStore`` from post-RoPE KV; the pool is a ``FakePool`` filled with a sentinel so
any write outside the reused rows shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_pic.engine import layer_feed
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.layer_feed import (
    CLOSE_WAIT_S,
    FEED_MODES,
    CudaHandoff,
    FeedTimeout,
    HostHandoff,
    LayerFeed,
    MissingChunkError,
    feed_every_layer,
)
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.keys import ModelFingerprint
from sgl_pic.rope import apply_rope, default_inv_freq
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.loader import (
    ChunkPlacement,
    FetchedLayer,
    LoadedLayer,
    LoaderConfig,
    SparseLoader,
)
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.support.fakes import SENTINEL, ChunkData, FakePool, chunk_data

LAYERS, HEADS, DIM, SEG = 4, 2, 8, 4
INV_FREQ = default_inv_freq(DIM, 10000.0)
ROPE = ModelRope.plain(INV_FREQ, max_positions=64)
FP = ModelFingerprint(model_id="test-model", dtype="float32", pre_rope=True)
ROW_BYTES = HEADS * DIM * 4
POOL = 64
PROMPT = 22

# (seed, length, offset in the prompt, chunk-local recomputed indices). Chunk A's second
# segment (local 4..7) is recomputed whole: none of it is moved.
CHUNKS = ((1, 10, 3, [0, 4, 5, 6, 7]), (2, 6, 14, [2, 5]))
REUSED_ROWS = sum(n - len(rec) for _, n, _, rec in CHUNKS)
CHUNK_TOKENS = sum(n for _, n, _, _ in CHUNKS)


class Setup:
    def __init__(self, root: Path, disk_bytes: int) -> None:
        cfg = TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False),
            disk=DiskStoreConfig(root=str(root), capacity_bytes=disk_bytes),
            promote_on_get_layers=False,
        )
        self.store = TieredStore(cfg, FP.digest())
        self.lower = LowerTiers(self.store, FP, SEG, INV_FREQ)
        self.chunks: list[tuple[ChunkData, int, list[int]]] = []
        self.placements: list[ChunkPlacement] = []
        for seed, n, offset, rec in CHUNKS:
            c = chunk_data(seed, n, LAYERS, HEADS, DIM, INV_FREQ)
            self.lower.put_chunk(c.tokens, c.pre_k, c.v, c.ranking)
            hit = self.lower.match(c.tokens)
            assert hit is not None and hit.tier == "host"
            self.placements += self.lower.placements(hit, c.tokens, offset, torch.tensor(rec))
            self.chunks.append((c, offset, rec))
        g = torch.Generator().manual_seed(0)
        # The request's slots, by global position: scattered over the pool, never slot 0.
        self.slots = torch.randperm(POOL - 1, generator=g)[:PROMPT] + 1
        self.store.flush()

    def feed(
        self,
        mode: str,
        pool: FakePool,
        depth: int = 2,
        loader: SparseLoader | None = None,
        kv: KVAccess | None = None,
    ) -> LayerFeed:
        kv = kv or KVAccess(pool, LAYERS, ROPE)
        return LayerFeed(
            loader or self.lower.loader,
            self.placements,
            self.slots,
            kv,
            LAYERS,
            mode=mode,
            depth=depth,
            timeout_s=20.0,
        )

    def expected_pool(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """# [LAYERS, POOL, HEADS, DIM] K and V once layers 0..upto-1 are fed."""
        k = torch.full((LAYERS, POOL, HEADS, DIM), SENTINEL)
        v = k.clone()
        for c, offset, rec in self.chunks:
            reuse = [i for i in range(len(c.tokens)) if i not in rec]
            idx = torch.tensor(reuse)
            dest = self.slots[offset + idx]
            for layer in range(upto):
                k[layer, dest] = apply_rope(c.pre_k[layer, idx], offset + idx, INV_FREQ)
                v[layer, dest] = c.v[layer, idx]
        return k, v


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, disk_bytes=1 << 22)
    yield s
    s.store.close()


@pytest.fixture
def host_only(tmp_path: Path) -> Iterator[Setup]:
    """Records in host memory only (the disk takes nothing), so dropping them there
    makes them unreadable."""
    s = Setup(tmp_path, disk_bytes=0)
    assert all(
        s.store.locate(p.key) == "host" and not s.store.disk.contains(p.key) for p in s.placements
    )
    yield s
    s.store.close()


def feed_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "sgl-pic-feed"}


def run(
    s: Setup, mode: str, pool: FakePool, depth: int = 2, loader: SparseLoader | None = None
) -> LayerFeed:
    feed = s.feed(mode, pool, depth, loader=loader)
    before = feed_threads()
    feed.start()
    workers = feed_threads() - before
    assert len(workers) == (1 if mode == "threaded" else 0)
    try:
        for layer in range(LAYERS):
            moved, dense, tokens = feed.bytes_moved, feed.bytes_dense, feed.tokens_moved
            feed.before_layer(layer)
            assert feed.bytes_moved - moved == 2 * REUSED_ROWS * ROW_BYTES
            assert feed.bytes_dense - dense == 2 * CHUNK_TOKENS * ROW_BYTES
            assert feed.tokens_moved - tokens == REUSED_ROWS
            k, v = s.expected_pool(layer + 1)
            got_k, got_v = pool.snapshot()
            torch.testing.assert_close(got_k, k, atol=1e-5, rtol=0)
            assert torch.equal(got_v, v)  # later layers still all sentinel
        assert feed.done
    finally:
        feed.close()
    assert not any(w.is_alive() for w in workers)
    return feed


@pytest.mark.parametrize("mode", FEED_MODES)
def test_writes_exactly_the_reused_rows_rotated_into_their_slots(setup, mode) -> None:
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed = run(setup, mode, pool)
    assert feed.bytes_moved == LAYERS * 2 * REUSED_ROWS * ROW_BYTES
    assert feed.bytes_dense == LAYERS * 2 * CHUNK_TOKENS * ROW_BYTES


def test_threaded_and_inorder_fill_the_pool_identically(setup) -> None:
    pools = {mode: FakePool(POOL, LAYERS, HEADS, DIM) for mode in ("threaded", "inorder")}
    for mode, pool in pools.items():
        run(setup, mode, pool, depth=1 if mode == "threaded" else 2)
    (k1, v1), (k2, v2) = (p.snapshot() for p in pools.values())
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("mode", FEED_MODES)
def test_layers_must_come_in_order(setup, mode) -> None:
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed = setup.feed(mode, pool)
    feed.start()
    try:
        with pytest.raises(RuntimeError, match="expected layer 0"):
            feed.before_layer(1)
        untouched = pool.snapshot()
        assert all(torch.equal(a, torch.full_like(a, SENTINEL)) for a in untouched)
        feed.before_layer(0)
        with pytest.raises(RuntimeError, match="expected layer 1"):
            feed.before_layer(0)
        with pytest.raises(RuntimeError, match="expected layer 1"):
            feed.before_layer(2)
        feed.before_layer(1)
        assert not feed.done
    finally:
        feed.close()


@pytest.mark.parametrize("mode", FEED_MODES)
def test_a_record_dropped_mid_way_is_listed_and_the_forward_goes_on(host_only, mode) -> None:
    """A record gone between two layers does not stop the forward (raising there would
    leave the other tensor-parallel ranks in its collectives): every later layer is
    asked for and returns, nothing of the dropped records is written from the drop on,
    and the feed lists them for the executor, whose ranks then retry together."""
    s = host_only
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed = s.feed(mode, pool, depth=1)
    before = feed_threads()
    feed.start()
    workers = feed_threads() - before
    t0 = time.monotonic()
    try:
        feed.before_layer(0)
        # The worker may already be fetching layer 1, never layer 2 (depth 1).
        s.store.evict(1 << 30)
        assert not any(s.store.contains(p.key) for p in s.placements)
        for layer in range(1, LAYERS):
            feed.before_layer(layer)
        assert feed.done
    finally:
        feed.close()
    assert time.monotonic() - t0 < 10.0  # no wait for the timeout
    assert not any(w.is_alive() for w in workers)
    reused = {p.key for p in s.placements if p.reuse.numel()}
    assert set(feed.missing) == reused and len(feed.missing) == len(reused)
    k, v = pool.snapshot()
    want_k, want_v = s.expected_pool(1)
    torch.testing.assert_close(k[0], want_k[0], atol=1e-5, rtol=0)
    assert torch.equal(v[0], want_v[0])
    assert torch.equal(k[2:], want_k[2:]) and torch.equal(v[2:], want_v[2:])  # sentinel


@pytest.mark.parametrize("mode", FEED_MODES)
def test_feeding_every_layer_raises_for_a_dropped_record_once_done(host_only, mode) -> None:
    """Outside a forward (``feed_every_layer``) a record that could not be read is an
    error, raised after every layer was asked for."""
    s = host_only
    s.store.evict(1 << 30)
    feed = s.feed(mode, FakePool(POOL, LAYERS, HEADS, DIM))
    with pytest.raises(MissingChunkError):
        feed_every_layer(feed)
    assert feed.done and feed.missing


def test_close_stops_an_idle_worker(setup) -> None:
    feed = setup.feed("threaded", FakePool(POOL, LAYERS, HEADS, DIM))
    before = feed_threads()
    feed.start()
    workers = feed_threads() - before
    assert len(workers) == 1
    t0 = time.monotonic()
    feed.close()  # nothing consumed: the worker waits for room ahead of the forward
    assert time.monotonic() - t0 < 5.0
    assert not any(w.is_alive() for w in workers)


class CountingLoader(SparseLoader):
    def __init__(self, store: TieredStore) -> None:
        super().__init__(store, INV_FREQ, LoaderConfig())
        self.fetched: list[int] = []

    def fetch_layer(self, chunks, layer: int) -> FetchedLayer:  # noqa: ANN001
        self.fetched.append(layer)
        return super().fetch_layer(chunks, layer)


def wait_for(cond, timeout: float = 5.0) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_worker_stays_at_most_depth_layers_ahead(setup) -> None:
    loader = CountingLoader(setup.store)
    feed = setup.feed("threaded", FakePool(POOL, LAYERS, HEADS, DIM), depth=2, loader=loader)
    feed.start()
    try:
        assert wait_for(lambda: len(loader.fetched) == 2)
        time.sleep(0.3)
        assert loader.fetched == [0, 1]
        feed.before_layer(0)
        assert wait_for(lambda: len(loader.fetched) == 3)
        time.sleep(0.3)
        assert loader.fetched == [0, 1, 2]
    finally:
        feed.close()


class ThreadCountLoader(CountingLoader):
    def __init__(self, store: TieredStore) -> None:
        super().__init__(store)
        self.threads: set[int] = set()

    def fetch_layer(self, chunks, layer: int) -> FetchedLayer:  # noqa: ANN001
        self.threads.add(torch.get_num_threads())
        return super().fetch_layer(chunks, layer)


def test_worker_loads_confined_to_its_own_thread(setup) -> None:
    # Loads overlap the forward: they must not bring up an OpenMP team of their own.
    loader = ThreadCountLoader(setup.store)
    run(setup, "threaded", FakePool(POOL, LAYERS, HEADS, DIM), loader=loader)
    assert loader.threads == {1}


def test_inorder_fetches_on_demand(setup) -> None:
    loader = CountingLoader(setup.store)
    feed = setup.feed("inorder", FakePool(POOL, LAYERS, HEADS, DIM), loader=loader)
    feed.start()
    assert loader.fetched == []
    feed.before_layer(0)
    feed.before_layer(1)
    assert loader.fetched == [0, 1]
    feed.close()


def test_everything_recomputed_writes_nothing(setup) -> None:
    full = [
        ChunkPlacement(p.key, p.num_tokens, p.offset, torch.arange(p.num_tokens), p.token_ids)
        for p in setup.placements
    ]
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed = LayerFeed(setup.lower.loader, full, setup.slots, KVAccess(pool, LAYERS, ROPE), LAYERS)
    feed_every_layer(feed)
    assert feed.done and feed.bytes_moved == 0 and feed.tokens_moved == 0
    assert all(torch.equal(a, torch.full_like(a, SENTINEL)) for a in pool.snapshot())


def test_bad_arguments_are_refused(setup) -> None:
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    with pytest.raises(ValueError, match="unknown feed mode"):
        setup.feed("cuda-stream", pool)
    with pytest.raises(ValueError, match="depth"):
        setup.feed("threaded", pool, depth=0)
    kv = KVAccess(pool, LAYERS, ROPE)
    with pytest.raises(ValueError, match="timeout_s"):
        LayerFeed(setup.lower.loader, setup.placements, setup.slots, kv, LAYERS, timeout_s=0)


class BlockingLoader(SparseLoader):
    """Fetches normally, except layer ``stuck_at``, whose read hangs until ``release``."""

    def __init__(self, store: TieredStore, stuck_at: int) -> None:
        super().__init__(store, INV_FREQ, LoaderConfig())
        self.stuck_at = stuck_at
        self.entered = threading.Event()
        self.release = threading.Event()

    def fetch_layer(self, chunks, layer: int) -> FetchedLayer:  # noqa: ANN001
        if layer == self.stuck_at:
            self.entered.set()
            self.release.wait(60)
        return super().fetch_layer(chunks, layer)


def stuck_feed(s: Setup, pool: FakePool, timeout_s: float) -> tuple[LayerFeed, BlockingLoader]:
    loader = BlockingLoader(s.store, stuck_at=1)
    kv = KVAccess(pool, LAYERS, ROPE)
    return LayerFeed(loader, s.placements, s.slots, kv, LAYERS, timeout_s=timeout_s), loader


@pytest.mark.parametrize("close_first", [True, False])
def test_a_stuck_read_times_the_feed_out_and_the_worker_ends(setup, close_first) -> None:
    """Layer 1's read hangs: after about timeout_s the feed is ``timed_out`` and skips
    every later layer without raising (other tensor-parallel ranks are in the forward's
    collectives; the executor agrees on it after the forward), ``close`` does not wait the
    read out, and when the read finally returns the worker ends without writing anything
    (the request's slots keep layer 0 only, for the rerun to overwrite). The timeout alone
    stops the worker, even if ``close`` is never called."""
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed, loader = stuck_feed(setup, pool, timeout_s=0.5)
    before = feed_threads()
    feed.start()
    workers = feed_threads() - before
    assert len(workers) == 1
    feed.before_layer(0)
    # The worker must be inside layer 1's read before the timeout starts: a starved one
    # that had not reached it would see the stop and end without reading.
    assert loader.entered.wait(10)
    t0 = time.monotonic()
    feed.before_layer(1)
    assert 0.45 < time.monotonic() - t0 < 3.0
    assert feed.timed_out and not feed.done
    t1 = time.monotonic()
    for layer in range(2, LAYERS):
        feed.before_layer(layer)  # skipped at once
    assert time.monotonic() - t1 < 0.4 and feed.done
    assert loader.entered.is_set() and feed.worker_alive  # still inside the read
    if close_first:
        t1 = time.monotonic()
        feed.close()
        assert time.monotonic() - t1 < CLOSE_WAIT_S + 1.0
        assert feed.worker_alive
    after_timeout = pool.snapshot()
    want_k, want_v = setup.expected_pool(1)
    torch.testing.assert_close(after_timeout[0], want_k, atol=1e-5, rtol=0)
    assert torch.equal(after_timeout[1], want_v)
    loader.release.set()  # the read returns at last
    assert wait_for(lambda: not any(w.is_alive() for w in workers))
    assert not feed.worker_alive
    later = pool.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(later, after_timeout, strict=True))
    feed.close()


class RecordingHandoff(HostHandoff):
    """The CPU stand-in for ``CudaHandoff``: logs every step with its thread, so the
    ordering the CUDA path relies on (issue and record on the worker, wait before the
    pool write on the forward) is checked where no GPU is present."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, str]] = []
        self._issuing = threading.local()

    def _note(self, step: str, layer: int) -> None:
        self.log.append((step, layer, threading.current_thread().name))

    @contextmanager
    def issuing(self) -> Iterator[None]:
        self._issuing.on = True
        try:
            yield
        finally:
            self._issuing.on = False

    def to_pool_device(self, fetched: FetchedLayer) -> FetchedLayer:
        assert getattr(self._issuing, "on", False), "rows moved outside the side stream"
        self._note("move", fetched.layer)
        return fetched

    def record(self, layer: int) -> None:
        assert getattr(self._issuing, "on", False), "event recorded outside the side stream"
        self._note("record", layer)

    def wait(self, layer: int) -> None:
        self._note("wait", layer)

    def retire(self, loaded: LoadedLayer) -> None:
        self._note("retire", loaded.layer)


class LoggingKV(KVAccess):
    def __init__(self, pool: FakePool, log: list[tuple[str, int, str]]) -> None:
        super().__init__(pool, LAYERS, ROPE)
        self.log = log

    def write_layer(self, layer, slots, k, v) -> None:  # noqa: ANN001
        self.log.append(("write", layer, threading.current_thread().name))
        super().write_layer(layer, slots, k, v)


def test_threaded_hands_over_each_layer_in_stream_order(setup, monkeypatch) -> None:
    """Per layer: moved and recorded on the worker, inside the issuing context; waited on
    by the forward before it writes the pool; retired after the write. The pool ends
    as in the plain CPU run."""
    handoff = RecordingHandoff()
    devices: list[torch.device] = []

    def fake_make(device: torch.device, num_layers: int) -> HostHandoff:
        devices.append(device)
        return handoff

    monkeypatch.setattr(layer_feed, "make_handoff", fake_make)
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed = setup.feed("threaded", pool, kv=LoggingKV(pool, handoff.log))
    assert devices == [torch.device("cpu")]
    feed_every_layer(feed)
    main = threading.current_thread().name
    for layer in range(LAYERS):
        steps = [(s, t) for s, lay, t in handoff.log if lay == layer]
        assert steps == [
            ("move", "sgl-pic-feed"),
            ("record", "sgl-pic-feed"),
            ("wait", main),
            ("write", main),
            ("retire", main),
        ], steps
    k, v = setup.expected_pool(LAYERS)
    got_k, got_v = pool.snapshot()
    torch.testing.assert_close(got_k, k, atol=1e-5, rtol=0)
    assert torch.equal(got_v, v)


def test_inorder_and_cpu_pools_need_no_handoff(setup) -> None:
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    for mode in FEED_MODES:
        feed = setup.feed(mode, pool)
        assert type(feed._handoff) is HostHandoff
        feed.close()
    assert type(layer_feed.make_handoff(torch.device("cpu"), LAYERS)) is HostHandoff


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
)


def cuda_pool() -> FakePool:
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    pool.k_buffer = [b.cuda() for b in pool.k_buffer]
    pool.v_buffer = [b.cuda() for b in pool.v_buffer]
    return pool


@needs_cuda
@pytest.mark.parametrize("mode", FEED_MODES)
def test_cuda_pool_matches_the_cpu_result(setup, mode) -> None:
    cpu = FakePool(POOL, LAYERS, HEADS, DIM)
    run(setup, "inorder", cpu)
    pool = cuda_pool()
    feed = setup.feed(mode, pool)
    assert isinstance(feed._handoff, CudaHandoff) == (mode == "threaded")
    feed_every_layer(feed)
    torch.cuda.current_stream().synchronize()
    (k, v), (want_k, want_v) = pool.snapshot(), cpu.snapshot()
    torch.testing.assert_close(k.cpu(), want_k, atol=1e-5, rtol=0)
    assert torch.equal(v.cpu(), want_v)


class SlowStreamLoader(SparseLoader):
    """Puts a long device-side sleep on the current (side) stream before each fetch: the
    copies land late on the device although the worker issues them at once."""

    def fetch_layer(self, chunks, layer: int) -> FetchedLayer:  # noqa: ANN001
        # About 1.5 s on the last layer: a host stall shorter than that cannot let the
        # copy finish before the test looks.
        torch.cuda._sleep(3_000_000_000 if layer == LAYERS - 1 else 20_000_000)
        return super().fetch_layer(chunks, layer)


@needs_cuda
def test_cuda_forward_waits_on_events_not_on_the_host(setup) -> None:
    """before_layer returns while the last layer's copy is still queued behind the
    sleep (no host sync), yet the rows the forward stream writes are the loaded ones
    (its stream waited for the side stream's event)."""
    cpu = FakePool(POOL, LAYERS, HEADS, DIM)
    run(setup, "inorder", cpu)
    pool = cuda_pool()
    loader = SlowStreamLoader(setup.store, INV_FREQ, LoaderConfig())
    feed = setup.feed("threaded", pool, loader=loader)
    feed.start()
    try:
        for layer in range(LAYERS):
            feed.before_layer(layer)
        handoff = feed._handoff
        assert isinstance(handoff, CudaHandoff)
        assert not handoff.events[LAYERS - 1].query(), "before_layer synchronized the host"
        assert handoff.stream != torch.cuda.current_stream()
    finally:
        feed.close()
    torch.cuda.current_stream().synchronize()
    (k, v), (want_k, want_v) = pool.snapshot(), cpu.snapshot()
    torch.testing.assert_close(k.cpu(), want_k, atol=1e-5, rtol=0)
    assert torch.equal(v.cpu(), want_v)


class PoolStreams:
    """torch's CUDA stream pool as far as ``side_stream`` sees it: ``Stream(device,
    priority)`` hands out handles round robin from ``handles``; ``current_stream`` is
    the stream with handle ``current``."""

    def __init__(self, handles: list[int], current: int) -> None:
        self.handles = handles
        self.current = SimpleNamespace(cuda_stream=current)
        self.drawn: list[SimpleNamespace] = []

    def stream(self, device: Any = None, priority: int = 0) -> SimpleNamespace:
        s = SimpleNamespace(
            cuda_stream=self.handles[len(self.drawn) % len(self.handles)],
            device=device,
            priority=priority,
        )
        self.drawn.append(s)
        return s

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "Stream", self.stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: SimpleNamespace())


def test_the_side_stream_is_never_the_forward_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's next stream is the forward's own (SGLang draws its forward stream from
    the same pool): the handoff draws past it, at high priority."""
    streams = PoolStreams([7, 7, 9], current=7)
    streams.patch(monkeypatch)
    handoff = CudaHandoff(torch.device("cuda", 0), LAYERS)
    assert handoff.stream.cuda_stream == 9
    assert all(s.priority == layer_feed.SIDE_STREAM_PRIORITY < 0 for s in streams.drawn)
    assert len(handoff.events) == LAYERS


def test_a_pool_of_only_the_forward_stream_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    PoolStreams([7], current=7).patch(monkeypatch)
    with pytest.raises(RuntimeError, match="distinct from the current one"):
        layer_feed.side_stream(torch.device("cuda", 0))


def test_feed_every_layer_raises_feed_timeout_once_every_layer_was_asked(setup) -> None:
    """Outside a forward (calibration) no other rank waits: a layer not loaded in time is
    raised, after the remaining layers were skipped."""
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    feed, loader = stuck_feed(setup, pool, timeout_s=0.3)
    with pytest.raises(FeedTimeout, match="not loaded"):
        feed_every_layer(feed)
    assert feed.timed_out and feed.done
    loader.release.set()


class FailingLoader(SparseLoader):
    """Fetches normally, except layer 1, whose read raises (not a missing record)."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(store, INV_FREQ, LoaderConfig())

    def fetch_layer(self, chunks, layer: int) -> FetchedLayer:  # noqa: ANN001
        if layer == 1:
            raise MemoryError("staging buffer")
        return super().fetch_layer(chunks, layer)


def test_a_worker_error_is_not_raised_mid_forward_the_feed_gives_up(setup) -> None:
    """Another tensor-parallel rank is in the forward's collectives: the feed marks itself
    failed and skips the remaining layers; the executor agrees on it after phase 2.
    Outside a forward (``feed_every_layer``) the error is raised once every layer was
    asked for."""
    pool = FakePool(POOL, LAYERS, HEADS, DIM)
    kv = KVAccess(pool, LAYERS, ROPE)
    feed = LayerFeed(FailingLoader(setup.store), setup.placements, setup.slots, kv, LAYERS)
    feed.start()
    try:
        for layer in range(LAYERS):
            feed.before_layer(layer)
    finally:
        feed.close()
    assert feed.failed and feed.gave_up and feed.done and not feed.timed_out
    again = LayerFeed(FailingLoader(setup.store), setup.placements, setup.slots, kv, LAYERS)
    with pytest.raises(MemoryError, match="staging"):
        feed_every_layer(again)
