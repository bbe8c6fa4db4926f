"""Eviction order of the host and disk tiers' shared bookkeeping (``sgl_pic.store.eviction``),
driven through the host tier."""

from __future__ import annotations

import pytest

from sgl_pic.store.base import ChunkKV
from sgl_pic.store.eviction import check_policy, gdsf_priority
from sgl_pic.store.host import HostStore, HostStoreConfig
from tests.store.helpers import MODEL, make_record

REC_BYTES = make_record().nbytes


def host(n_records: float, policy: str) -> HostStore:
    return HostStore(HostStoreConfig(int(n_records * REC_BYTES), policy=policy), MODEL)


def use(store: HostStore, record: ChunkKV) -> bool:
    """A request needing ``record``: True on a hit; on a miss it is computed and stored."""
    if store.get(record.key) is not None:
        return True
    store.put(record)
    return False


def churn(policy: str, rounds: int = 8, novel_per_round: int = 8) -> tuple[int, int]:
    """Two hot chunks used in every round, between rounds more novel chunks than the tier
    holds; (hot hits, novel chunks still held from the last round)."""
    store = host(6, policy)
    hot = [make_record(seed=1000 + i) for i in range(2)]
    for _ in range(3):  # a warm-up in which the hot chunks are used a few times
        for r in hot:
            use(store, r)
    hot_hits = 0
    seed = 0
    last: list[ChunkKV] = []
    for _ in range(rounds):
        last = [make_record(seed=seed + i) for i in range(novel_per_round)]
        seed += novel_per_round
        for r in last:
            assert not use(store, r)  # novel: never seen before
        hot_hits += sum(use(store, r) for r in hot)
    return hot_hits, sum(store.contains(r.key) for r in last)


def test_gdsf_keeps_the_hot_set_through_a_churn_of_novel_chunks() -> None:
    gdsf_hits, gdsf_novel = churn("gdsf")
    lru_hits, _ = churn("lru")
    assert lru_hits == 0  # every round's novel chunks push the hot ones out
    assert gdsf_hits == 2 * 8  # the hot chunks hit in every round
    assert gdsf_novel == 4  # novel chunks are still admitted, into the room left


def test_gdsf_ages_out_a_chunk_that_stopped_being_used() -> None:
    store = host(4, "gdsf")
    old = make_record(seed=999)
    store.put(old)
    for _ in range(3):
        assert store.get(old.key) is not None
    # Each novel chunk enters above the age; the age climbs by one novel chunk's priority
    # per turnover of the tier, so a chunk used 4 times outlives a few turnovers, not all.
    survived = 0
    for i in range(40):
        store.put(make_record(seed=i))
        if not store.contains(old.key):
            break
        survived += 1
    assert 3 * 3 <= survived < 40


def test_gdsf_prefers_to_keep_the_smaller_of_equally_used_chunks() -> None:
    store = HostStore(HostStoreConfig(int(3.5 * REC_BYTES), policy="gdsf"), MODEL)
    big = make_record(seed=1, num_tokens=80)  # twice REC_BYTES
    small = make_record(seed=2)
    store.put(small)  # older than big: LRU would evict it first
    store.put(big)
    store.put(make_record(seed=3))  # 4 records' worth offered to 3.5: one must go
    assert store.contains(small.key) and not store.contains(big.key)


def test_gdsf_priority_and_policy_names() -> None:
    assert gdsf_priority(2.0, 3, 6) == pytest.approx(2.5)
    assert gdsf_priority(0.0, 1, 0) == 1.0  # an empty entry does not divide by zero
    for name in ("lru", "lfu", "gdsf"):
        check_policy(name)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'.*gdsf"):
        check_policy("mru")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        HostStoreConfig(1, policy="mru")
