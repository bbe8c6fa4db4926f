"""Fair share in the host and disk tiers (``namespace_max_bytes``): one tenant's churn
never evicts another's entries while that one is within its cap; GDSF inside each share."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from sgl_pic.store.base import ChunkKV
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.eviction import EVICTION_POLICIES
from sgl_pic.store.host import HostStore, HostStoreConfig
from tests.store.helpers import MODEL, make_record

NS_A, NS_B, NS_C = "a" * 64, "b" * 64, "c" * 64


def small(seed: int, namespace: str) -> ChunkKV:
    r = make_record(seed=seed, num_layers=1, num_tokens=4, heads=1, head_dim=4)
    return replace(r, namespace=namespace)


REC = small(0, "").nbytes


def host(capacity_records: int, cap_records: int, policy: str = "gdsf") -> HostStore:
    cfg = HostStoreConfig(
        capacity_records * REC,
        policy=policy,
        pin_memory=False,
        namespace_max_bytes=cap_records * REC,
    )
    return HostStore(cfg, MODEL)


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(EVICTION_POLICIES),
    cap=st.integers(2, 5),
    spare=st.integers(1, 6),
    b_count=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from("ngb"), st.integers(0, 30)), max_size=80),
)
def test_a_churning_tenant_never_evicts_one_within_its_cap(
    policy: str, cap: int, spare: int, b_count: int, ops: list[tuple[str, int]]
) -> None:
    """Tenant B stores up to its cap; tenant A stores novel chunks ("n"), uses its own
    again ("g"), B uses its own ("b"). The tier may hold less than both caps together;
    it has room for A's first chunk (with none of its own, A would evict another's:
    nothing else is left)."""
    store = host(cap + spare, cap, policy)
    b_records = [small(10_000 + i, NS_B) for i in range(min(b_count, cap))]
    for r in b_records:
        assert store.put(r)
    a_seen: list[ChunkKV] = []
    for op, n in ops:
        if op == "n":
            r = small(len(a_seen) + 1, NS_A)
            a_seen.append(r)
            store.put(r)
        elif op == "g" and a_seen:
            store.get(a_seen[n % len(a_seen)].key)
        elif op == "b":
            store.get(b_records[n % len(b_records)].key)
        assert all(store.contains(r.key) for r in b_records)
        shares = store.bytes_by_namespace()
        assert shares.get(NS_A, 0) <= cap * REC and shares[NS_B] <= cap * REC
    if len(a_seen) > cap:
        # A churned inside its share: its cap, or what B left of the tier.
        room = min(cap, cap + spare - len(b_records))
        assert store.bytes_by_namespace()[NS_A] == room * REC


@pytest.mark.parametrize("policy", ["gdsf", "lru"])
def test_the_policy_orders_eviction_inside_a_share(policy: str) -> None:
    """A tenant's chunk used 30 times outlives 20 novel chunks of its own under GDSF (LRU
    drops it), while another tenant fills the rest of the tier."""
    store = host(10, 3, policy)
    hot = small(1, NS_A)
    store.put(hot)
    for _ in range(30):
        assert store.get(hot.key) is not None
    for i in range(3):
        store.put(small(200 + i, NS_B))
    for i in range(20):
        store.put(small(100 + i, NS_A))
    assert store.contains(hot.key) == (policy == "gdsf")
    assert store.bytes_by_namespace() == {NS_A: 3 * REC, NS_B: 3 * REC}


def test_others_are_evicted_only_when_nothing_else_is_left() -> None:
    store = host(4, 3)
    a = [small(i, NS_A) for i in range(3)]
    for r in a:
        store.put(r)
    b1 = small(50, NS_B)
    assert store.put(b1)  # the tier is now full, every tenant within its cap
    # C holds nothing: nothing of its own to evict, so the policy's first victim goes.
    assert store.put(small(60, NS_C))
    assert sum(store.contains(r.key) for r in a) + store.contains(b1.key) == 3
    # B again, within its cap: its own chunk goes before anyone else's.
    held_a = [r.key for r in a if store.contains(r.key)]
    if store.contains(b1.key):
        assert store.put(small(51, NS_B))
        assert not store.contains(b1.key)
        assert all(store.contains(k) for k in held_a)


def test_a_record_larger_than_the_cap_is_refused() -> None:
    store = host(10, 1)
    big = replace(
        make_record(seed=1, num_layers=1, num_tokens=8, heads=1, head_dim=4), namespace=NS_A
    )
    assert not store.put(big)
    assert store.stats().rejected_puts == 1 and store.stats().entries == 0


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_disk_shares(tmp_path: Path, policy: str) -> None:
    probe = DiskStore(DiskStoreConfig(str(tmp_path / "probe"), 1 << 20), MODEL)
    probe.put(small(0, NS_A))
    size = probe.stats().bytes_used  # one record's file
    cfg = DiskStoreConfig(
        str(tmp_path / "d"), 6 * size, policy=policy, namespace_max_bytes=3 * size
    )
    store = DiskStore(cfg, MODEL)
    b_records = [small(500 + i, NS_B) for i in range(3)]
    for r in b_records:
        assert store.put(r)
    for i in range(30):
        assert store.put(small(i + 1, NS_A))
        assert all(store.contains(r.key) for r in b_records)
    assert store.bytes_by_namespace() == {NS_A: 3 * size, NS_B: 3 * size}
    files = sum(1 for _ in (tmp_path / "d").rglob("*.sglkv"))
    assert files == 6
    # The index rebuilt at start-up knows each file's tenant again.
    again = DiskStore(cfg, MODEL)
    assert again.bytes_by_namespace() == {NS_A: 3 * size, NS_B: 3 * size}


def test_config_refuses_a_negative_cap(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        HostStoreConfig(1, namespace_max_bytes=-1)
    with pytest.raises(ValueError):
        DiskStoreConfig(str(tmp_path), 1, namespace_max_bytes=-1)


def test_without_caps_tenants_do_not_change_the_order() -> None:
    """No cap: eviction follows the policy over all entries, whoever stored them."""
    store = host(3, 0, "lru")
    b = small(1, NS_B)
    store.put(b)
    a = [small(10 + i, NS_A) for i in range(2)]
    for r in a:
        store.put(r)
    store.put(small(20, NS_A))  # the least recently used entry is B's: it goes
    assert not store.contains(b.key) and all(store.contains(r.key) for r in a)
