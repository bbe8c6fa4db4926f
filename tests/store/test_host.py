import dataclasses
import threading
import time

import pytest
import torch

from sgl_pic.store.format import WriteCancelled
from sgl_pic.store.host import HostStore, HostStoreConfig, WriteBack, WriteBackConfig
from tests.store.helpers import MODEL, OTHER_MODEL, make_record, same_record

REC_BYTES = make_record().nbytes


def host(n_records: float = 10, **kw) -> HostStore:
    return HostStore(HostStoreConfig(capacity_bytes=int(n_records * REC_BYTES), **kw), MODEL)


def test_round_trip_and_put_copies(record):
    store = host()
    original = make_record()
    assert store.put(record)
    record.k.add_(1.0)  # the caller reuses its buffer after put
    got = store.get(original.key, original.token_ids)
    assert got is not None and same_record(got, original)
    assert store.contains(original.key) and store.stats().entries == 1


def test_get_layers_sparse_copies_and_counts_bytes():
    rec = make_record(num_layers=4, num_tokens=50, layer_start=1)
    store = host()
    store.put(rec)
    part = store.get_layers(rec.key, range(2, 4), torch.tensor([7, 2, 49]))
    assert part is not None
    assert part.token_indices.tolist() == [2, 7, 49]
    assert torch.equal(part.k, rec.k[1:3, [2, 7, 49]])
    assert torch.equal(part.v, rec.v[1:3, [2, 7, 49]])
    assert part.bytes_read == 2 * 2 * 3 * rec.row_bytes
    part.k.zero_()  # a copy: the store is unchanged
    assert torch.equal(store.get(rec.key).k, rec.k)
    assert store.stats().bytes_read == part.bytes_read
    assert store.get_layers("0" * 64, range(1, 2)) is None


def test_miss_token_mismatch_foreign_and_oversized():
    store = host(n_records=1.5)
    rec = make_record()
    assert store.get(rec.key) is None
    store.put(rec)
    assert store.get(rec.key, [0] * rec.num_tokens) is None
    assert not store.contains(rec.key)  # a key with other tokens is dropped
    assert store.stats().errors["token_mismatch"] == 1
    assert not store.put(make_record(seed=2, model=OTHER_MODEL))
    assert not store.put(make_record(seed=3, num_tokens=200))
    s = store.stats()
    assert s.rejected_puts == 2 and s.entries == 0 and s.misses == 2


def test_lru_evicts_least_recently_used():
    store = host(n_records=3, policy="lru")
    a, b, c, d = (make_record(seed=i) for i in range(4))
    for r in (a, b, c):
        store.put(r)
    store.get(a.key)  # b is now the least recently used
    store.put(d)
    assert not store.contains(b.key)
    assert all(store.contains(r.key) for r in (a, c, d))


def test_lfu_evicts_least_frequently_used():
    store = host(n_records=3, policy="lfu")
    a, b, c, d = (make_record(seed=i) for i in range(4))
    for r in (a, b, c):
        store.put(r)
    for _ in range(3):
        store.get(a.key)
        store.get(b.key)
    store.get(c.key)  # c: most recent but least frequent
    store.put(d)
    assert not store.contains(c.key)
    assert all(store.contains(r.key) for r in (a, b, d))
    # The same accesses under LRU would have evicted a (least recent of a, b, c).
    lru = host(n_records=3, policy="lru")
    for r in (a, b, c):
        lru.put(r)
    for _ in range(3):
        lru.get(a.key)
        lru.get(b.key)
    lru.get(c.key)
    lru.put(d)
    assert not lru.contains(a.key)


def test_locked_entries_are_never_evicted():
    store = host(n_records=2)
    a, b, c = (make_record(seed=i) for i in range(3))
    store.put(a)
    store.put(b)
    assert store.lock(a.key) and store.lock(b.key)
    assert not store.put(c)  # everything is locked: rejected, nothing dropped
    assert store.contains(a.key) and store.contains(b.key)
    assert store.evict(10 * REC_BYTES).keys == ()
    store.unlock(b.key)
    assert store.put(c)
    assert store.contains(a.key) and not store.contains(b.key)
    # Locks nest: one unlock of a twice-locked key keeps it protected.
    store.lock(a.key)
    store.unlock(a.key)
    assert store.evict(10 * REC_BYTES).keys == (c.key,)
    store.unlock(a.key)
    assert store.evict(1).keys == (a.key,)
    assert not store.lock("0" * 64)


def test_a_put_that_cannot_fit_evicts_nothing():
    store = host(n_records=2)
    a, b = make_record(seed=1), make_record(seed=2)
    store.put(a)
    store.put(b)
    store.lock(a.key)
    # Fits only if the locked record went too: refused, and the unlocked one stays.
    assert not store.put(make_record(seed=3, num_tokens=2 * a.num_tokens))
    assert store.contains(a.key) and store.contains(b.key)
    assert store.stats().evictions == 0 and store.stats().rejected_puts == 1


def test_locked_context_manager():
    store = host()
    a = make_record()
    store.put(a)
    with store.locked([a.key, "1" * 64]) as held:
        assert held == (a.key,)
        assert store.evict(REC_BYTES).keys == ()
    assert store.evict(REC_BYTES).keys == (a.key,)


def test_write_back_on_put_reaches_sink_after_flush():
    sunk = []
    store = HostStore(
        HostStoreConfig(capacity_bytes=10 * REC_BYTES), MODEL, write_back_to=sunk.append
    )
    recs = [make_record(seed=i) for i in range(3)]
    for r in recs:
        store.put(r)
    store.put(recs[0])  # already held: no second write-back
    store.flush()
    assert [r.key for r in sunk] == [r.key for r in recs]
    assert all(same_record(a, b) for a, b in zip(sunk, recs, strict=True))
    store.close()


def test_write_back_on_evict_demotes_only_evicted():
    sunk = []
    demoted = []
    store = HostStore(
        HostStoreConfig(capacity_bytes=2 * REC_BYTES, write_back="on_evict"),
        MODEL,
        write_back_to=sunk.append,
        on_evict=demoted.append,
    )
    a, b, c = (make_record(seed=i) for i in range(3))
    for r in (a, b, c):
        store.put(r)
    store.flush()
    assert [r.key for r in sunk] == [a.key]
    assert [r.key for r in demoted] == [a.key]
    store.close()


def test_write_back_queue_is_bounded_and_survives_failures():
    release = threading.Event()
    started = threading.Event()
    ran = []

    def slow() -> None:
        started.set()
        release.wait(5)
        ran.append("slow")

    def boom() -> None:
        raise OSError("disk gone")

    wb = WriteBack(WriteBackConfig(max_pending=2))
    assert wb.submit(slow)
    assert started.wait(5)
    # The worker holds `slow`; two more fit in the queue, the next is dropped.
    accepted = [wb.submit(boom), wb.submit(lambda: ran.append("after"))]
    for _ in range(20):
        if not wb.submit(lambda: ran.append("extra")):
            break
    release.set()
    wb.flush()
    stats = wb.stats()
    assert all(accepted) and stats.dropped == 1
    assert stats.failed == 1 and "after" in ran and ran[0] == "slow"
    wb.close()
    assert not wb.submit(lambda: None)
    assert wb.stats().dropped == 2  # refused after close: counted too
    assert not wb.thread_alive


def sleeper(ran: list[int], i: int, seconds: float):  # noqa: ANN201
    def job() -> None:
        time.sleep(seconds)
        ran.append(i)

    return job


def test_shutdown_runs_queued_jobs_until_the_deadline_and_drops_the_rest():
    ran: list[int] = []
    wb = WriteBack(WriteBackConfig(max_pending=16))
    for i in range(10):
        assert wb.submit(sleeper(ran, i, 0.1))
    t0 = time.monotonic()
    res = wb.shutdown(0.35)
    took = time.monotonic() - t0
    assert 0.3 < took < 1.5
    assert res.joined and not wb.thread_alive
    # The report counts what the drain did; on a slow runner a job may have finished
    # before it began, which only the cumulative counts hold.
    stats = wb.stats()
    assert stats.completed == len(ran) and 2 <= len(ran) <= 5
    assert ran == list(range(len(ran)))  # in order, the rest never started
    assert stats.completed + stats.cancelled == 10 and stats.failed == res.failed == 0
    assert stats.cancelled == res.cancelled and res.completed <= stats.completed
    assert not wb.submit(lambda: None) and wb.stats().dropped == 1
    again = wb.shutdown(5.0)  # idempotent
    assert (again.completed, again.cancelled, again.joined) == (0, 0, True)
    wb.close()


def test_shutdown_without_pending_jobs_returns_at_once():
    wb = WriteBack(WriteBackConfig())
    t0 = time.monotonic()
    res = wb.shutdown(10.0)
    assert time.monotonic() - t0 < 1.0
    assert res == res._replace(completed=0, failed=0, cancelled=0, joined=True)


def test_on_deadline_stops_the_running_job_which_counts_as_cancelled():
    stop = threading.Event()
    started = threading.Event()

    def write() -> None:
        started.set()
        if stop.wait(10):
            raise WriteCancelled("stopped")

    wb = WriteBack(WriteBackConfig())
    wb.submit(write)
    wb.submit(lambda: None)
    assert started.wait(5)
    res = wb.shutdown(0.1, on_deadline=stop.set)
    assert res.joined and res.cancelled == 2 and res.completed == 0
    assert wb.stats().cancelled == 2


def test_a_job_stuck_past_the_join_grace_is_reported_not_waited_for():
    release = threading.Event()
    started = threading.Event()

    def stuck() -> None:
        started.set()
        release.wait(10)

    wb = WriteBack(WriteBackConfig())
    wb.submit(stuck)
    assert started.wait(5)
    t0 = time.monotonic()
    res = wb.shutdown(0.1, join_s=0.2)
    assert time.monotonic() - t0 < 2.0
    assert not res.joined and res.cancelled == 1 and wb.thread_alive
    release.set()  # the read returns: the thread ends by itself
    deadline = time.monotonic() + 5
    while wb.thread_alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not wb.thread_alive


def test_stop_event_cuts_the_drain_short():
    ran: list[int] = []
    wb = WriteBack(WriteBackConfig())
    for i in range(20):
        wb.submit(sleeper(ran, i, 0.05))
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    res = wb.shutdown(30.0, stop=stop)
    assert time.monotonic() - t0 < 2.0
    stats = wb.stats()  # cumulative: a job may have finished before the drain began
    assert res.joined and res.cancelled == stats.cancelled > 0
    assert stats.completed + stats.cancelled == 20 and res.completed <= stats.completed


def test_host_shutdown_drops_later_write_backs():
    sunk = []
    store = HostStore(
        HostStoreConfig(capacity_bytes=10 * REC_BYTES), MODEL, write_back_to=sunk.append
    )
    a, b = make_record(seed=1), make_record(seed=2)
    store.put(a)
    res = store.shutdown(5.0)
    assert res is not None and res.completed == 1 and res.joined
    assert store.put(b) and store.contains(b.key)  # still a working memory tier
    stats = store.write_back_stats()
    assert stats is not None and stats.dropped == 1 and [r.key for r in sunk] == [a.key]
    assert host().shutdown(1.0) is None  # no sink, no thread


def test_config_validation():
    with pytest.raises(ValueError, match="valid"):
        HostStoreConfig(capacity_bytes=1, policy="fifo")
    with pytest.raises(ValueError):
        HostStoreConfig(capacity_bytes=-1)
    with pytest.raises(ValueError, match="valid"):
        HostStoreConfig(capacity_bytes=1, write_back="sometimes")


def test_write_back_jobs_run_confined_to_their_thread():
    # The worker's torch ops must not bring up an OpenMP team beside the forward's.
    seen: list[int] = []
    wb = WriteBack(WriteBackConfig())
    assert wb.submit(lambda: seen.append(torch.get_num_threads()))
    wb.close()
    assert seen == [1]


class OnDevice(torch.Tensor):
    """A tensor that reports a GPU as its device, as a ranking fresh from a CUDA forward
    does; torch ops on it (``clone``, ``to``) keep reporting that device."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_rankings_are_kept_as_plain_cpu_copies():
    """The host tier's records are read by the disk writer on another thread: a ranking
    must not stay a device tensor (nor share the caller's buffer) there."""
    record = make_record()
    src = record.ranking.clone().as_subclass(OnDevice)
    assert src.device.type == "cuda" and src.clone().device.type == "cuda"
    store = host()
    assert store.put(dataclasses.replace(record, ranking=src))
    got = store.get(record.key, record.token_ids)
    assert got is not None and got.ranking is not None
    assert type(got.ranking) is torch.Tensor and got.ranking.device.type == "cpu"
    assert got.ranking.dtype == torch.float32
    assert got.ranking.data_ptr() != src.data_ptr()
    torch.testing.assert_close(got.ranking, record.ranking)
