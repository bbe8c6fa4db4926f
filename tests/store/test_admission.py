"""Store admission without a server: which misses are stored on first sight."""

from __future__ import annotations

import pytest

from sgl_pic.store.admission import BatchAdmission, StoreAdmission


def test_always_stores_every_miss_and_second_sight_waits_for_one() -> None:
    always = StoreAdmission("always")
    assert all(always.lookup(k, stored=False) for k in range(200))
    doorkeeper = StoreAdmission("second_sight")
    assert not doorkeeper.lookup(1, stored=False)
    assert doorkeeper.lookup(1, stored=False)  # seen before: stored now
    assert doorkeeper.lookup(2, stored=True)  # held by a tier: nothing to decide
    assert doorkeeper.stats().deferred == 1


def test_adaptive_defers_first_sights_only_while_few_come_back() -> None:
    adm = StoreAdmission("adaptive", min_reuse=0.5, warmup=8, window=64)
    # Warm-up: every first sight is stored, whatever the rate.
    assert all(adm.lookup(k, stored=False) for k in range(8))
    assert adm.reuse_rate == 0.0
    # A churn of novel chunks: past warm-up, with nothing seen again, first sights wait.
    assert not adm.lookup(100, stored=False)
    assert adm.lookup(100, stored=False)  # its second sight is stored
    # Most chunks now come back (each sent again): first sights are stored again.
    for k in range(8):
        adm.lookup(k, stored=True)
    assert adm.reuse_rate == pytest.approx(9 / 9)
    assert adm.lookup(101, stored=False)
    s = adm.stats()
    assert (s.first_sights, s.seen_again, s.deferred) == (10, 9, 1)


def test_adaptive_window_forgets_oldest_first_sights() -> None:
    adm = StoreAdmission("adaptive", min_reuse=0.5, warmup=0, window=4)
    for k in range(4):
        adm.lookup(k, stored=False)
        adm.lookup(k, stored=True)  # each came back
    assert adm.reuse_rate == 1.0
    # Four novel chunks push those out: the rate is the stream's now, not its past.
    for k in range(10, 14):
        adm.lookup(k, stored=False)
    assert adm.stats().first_sights == 4 and adm.reuse_rate == 0.0
    assert not adm.lookup(20, stored=False)
    # A stored chunk the window forgot counts as seen again when it comes back.
    adm.lookup(0, stored=True)
    assert adm.stats().seen_again == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "lfu"},
        {"min_reuse": 1.5},
        {"warmup": -1},
        {"window": 0},
        # The window never holds more first sights than it has room for: such a warm-up
        # would never end, and adaptive would store every miss.
        {"warmup": 8, "window": 8},
    ],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StoreAdmission(**kwargs)


def test_restore_takes_back_the_lookups_since_a_snapshot() -> None:
    # A batch that fails does not leave its chunks counted as seen.
    adm = StoreAdmission("second_sight")
    state = adm.snapshot()
    first = [adm.lookup(k, stored=False) for k in (1, 2, 3)]
    adm.restore(state)
    assert [adm.lookup(k, stored=False) for k in (1, 2, 3)] == first == [False] * 3
    assert adm.stats() == (3, 0, 3, 0.0)


def test_a_retry_replays_the_first_attempts_decisions_and_counts_nothing_again() -> None:
    adm = StoreAdmission("second_sight")
    batch = BatchAdmission(adm)
    # Two requests of the batch share chunk 1; chunk 3 was on disk.
    first = [batch.lookup(1, False), batch.lookup(2, False), batch.lookup(1, False)]
    assert first == [False, False, True] and batch.lookup(3, True)
    counted = adm.stats()
    assert counted == (3, 2, 2, 2 / 3)
    batch.retry()
    # Chunk 3's record went bad: it misses now, and is stored afresh as it was stored.
    assert batch.lookup(3, False)
    assert [batch.lookup(1, False), batch.lookup(2, False), batch.lookup(1, False)] == first
    assert adm.stats() == counted


def test_a_chunk_the_first_attempt_stored_is_not_seen_again_by_the_retry() -> None:
    adm = StoreAdmission("adaptive")  # in warm-up: a first sight is stored
    batch = BatchAdmission(adm)
    assert batch.lookup(7, False)  # stored by the first attempt's phase 1
    batch.retry()
    assert batch.lookup(7, True)  # a hit now: still one first sight, not a comeback
    assert adm.stats() == (1, 0, 0, 0.0)


def test_an_abandoned_batch_takes_back_its_lookups_and_no_admission_stores_all() -> None:
    adm = StoreAdmission("second_sight")
    adm.lookup(1, False)
    before = adm.stats()
    batch = BatchAdmission(adm)
    batch.lookup(1, False)
    batch.lookup(2, False)
    batch.retry()
    batch.lookup(2, False)
    batch.abandon()
    assert adm.stats() == before
    assert BatchAdmission(None).lookup(5, False)
