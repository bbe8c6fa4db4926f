"""Tenants' walls in every chunk tier, without a server: chunk nodes, host memory, disk,
and two servers on one real shared store; the gate that fixes a request's namespace; the
public scope the operator may open."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.utils import storage_namespace_seed

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import AdmissionGate, AdmittedMarks
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.spans import MAC_KEY, MarkSigner, encode
from sgl_pic.core.tenants import (
    DEFAULT_NAMESPACE,
    PUBLIC_SCOPE_OPTION,
    TenantPolicy,
    isolation_namespace,
    tenant_policy,
)
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.keys import ModelFingerprint
from sgl_pic.layout import PromptLayout
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.shared.service import SharedStoreService
from sgl_pic.store.shared.store import SharedStore, SharedStoreConfig
from sgl_pic.store.store_link import LinkConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.store.shared_helpers import start_service
from tests.support.fakes import FakeAllocator, chunk_data

LAYERS, HEADS, DIM, SEG = 2, 1, 4, 4
INV_FREQ = default_inv_freq(DIM, 10000.0)
DEVICE_FP = ModelFingerprint(model_id="tenants-model", dtype="float32")
LOWER_FP = ModelFingerprint(model_id="tenants-model", dtype="float32", pre_rope=True)

# A tenant as SGLang sees one: (extra_key, cache_salt), either may be absent.
names = st.text(alphabet="abAB-_ 0", min_size=0, max_size=4)
tenants = st.tuples(st.none() | names, st.none() | names.filter(bool))
chunks = st.lists(st.integers(0, 40), min_size=1, max_size=9).map(tuple)


# Where the gates of these tests put honoured marks, by request id; emptied per test.
MARKS = AdmittedMarks()


@pytest.fixture(autouse=True)
def _fresh_marks() -> None:
    MARKS._by_rid.clear()


# --------------------------------------------------------------------- namespaces
@given(tenants, tenants)
def test_namespaces_part_requests_exactly_as_sglangs_storage_seed(a: Any, b: Any) -> None:
    """Two requests share a chunk namespace iff SGLang's own storage namespacing (its
    ``storage_namespace_seed`` of extra_key and cache_salt) puts them together."""
    ours = isolation_namespace(*a) == isolation_namespace(*b)
    assert ours == (storage_namespace_seed(*a) == storage_namespace_seed(*b))
    assert (isolation_namespace(*a) == DEFAULT_NAMESPACE) == (storage_namespace_seed(*a) is None)


def test_an_empty_salt_is_no_salt_as_in_sglangs_req() -> None:
    assert isolation_namespace(None, "") == isolation_namespace(None, None) == DEFAULT_NAMESPACE
    assert isolation_namespace("", None) != DEFAULT_NAMESPACE  # SGLang keys "" apart too


# --------------------------------------------------------------------- tiers
class Tiers:
    """One instance of each tier: fresh chunk nodes, host-only and disk-only lower tiers,
    and two servers' lower tiers over one shared store (``a`` writes, ``b`` reads)."""

    def __init__(self, root: Path, shared_url: str) -> None:
        self.nodes = ChunkNodeTable(FakeAllocator(4096), DEVICE_FP, SEG, 4096)
        self.host = LowerTiers(self._store(root / "h", host=True), LOWER_FP, SEG, INV_FREQ)
        self.disk = LowerTiers(self._store(root / "d", host=False), LOWER_FP, SEG, INV_FREQ)
        self.a = self._server(root / "a", shared_url)
        self.b = self._server(root / "b", shared_url)
        # What the tiers hold so far (they live across examples): (namespace, tokens).
        self.held: set[tuple[str, tuple[int, ...]]] = set()

    @staticmethod
    def _store(root: Path, host: bool) -> TieredStore:
        cfg = TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=(1 << 22) if host else 0, pin_memory=False),
            disk=DiskStoreConfig(root=str(root), capacity_bytes=0 if host else 1 << 22),
        )
        return TieredStore(cfg, LOWER_FP.digest())

    @staticmethod
    def _server(root: Path, url: str) -> LowerTiers:
        shared = SharedStore(
            SharedStoreConfig(url, link=LinkConfig(retry_s=0.5)), LOWER_FP.digest()
        )
        assert shared.link.wait_connected(15)
        cfg = TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=0, pin_memory=False),
            disk=DiskStoreConfig(root=str(root), capacity_bytes=0),
        )
        return LowerTiers(
            TieredStore(cfg, LOWER_FP.digest(), shared=shared), LOWER_FP, SEG, INV_FREQ
        )

    def close(self) -> None:
        for t in (self.host, self.disk, self.a, self.b):
            t.store.close()


@pytest.fixture(scope="module")
def service() -> Iterator[SharedStoreService]:
    svc = start_service()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def tiers(service: SharedStoreService) -> Iterator[Tiers]:
    with tempfile.TemporaryDirectory() as root:
        t = Tiers(Path(root), service.url)
        yield t
        t.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    spaces=st.lists(tenants, min_size=2, max_size=4),
    stored=st.lists(st.tuples(st.integers(0, 3), chunks), min_size=1, max_size=4),
)
def test_no_lookup_crosses_namespaces_in_any_tier(
    tiers: Tiers, spaces: list[Any], stored: list[tuple[int, tuple[int, ...]]]
) -> None:
    """Chunks stored under random namespaces are found, in every tier, by exactly the
    namespace that stored them (other servers too, through the shared store) and by no
    other, however the namespaces and token lists collide."""
    ns = [isolation_namespace(*t) for t in spaces]
    held = tiers.held
    for i, toks in stored:
        space = ns[i % len(ns)]
        data = chunk_data(len(toks), len(toks), LAYERS, HEADS, DIM, INV_FREQ)
        inserted = tiers.nodes.insert(toks, None, space)
        assert inserted is not None
        for t in (tiers.host, tiers.disk, tiers.a):
            t.put_chunk(toks, data.pre_k, data.v, data.ranking, space)
        held.add((space, toks))
    tiers.a.store.flush()
    for space in ns:
        for _, toks in stored:
            want = (space, toks) in held
            assert (tiers.nodes.match(toks, space) is not None) == want
            assert (tiers.host.match(toks, space) is not None) == want
            assert (tiers.disk.match(toks, space) is not None) == want
            hit = tiers.b.match(toks, space)  # the other server, through the shared store
            assert (hit is not None) == want
            if hit is not None:
                assert hit.tier == "shared" and hit.namespace == space


def test_every_tier_keeps_the_namespace_beside_the_record(tiers: Tiers) -> None:
    """Host, disk and shared records name their tenant, so a tenant's records can be found
    without knowing their tokens (a restarted server reads it back from the files)."""
    space = isolation_namespace(None, "keeps-its-name")
    toks = (41, 42, 43, 44, 45, 46)
    data = chunk_data(7, len(toks), LAYERS, HEADS, DIM, INV_FREQ)
    for t in (tiers.host, tiers.disk, tiers.a):
        t.put_chunk(toks, data.pre_k, data.v, data.ranking, space)
    tiers.a.store.flush()
    for t in (tiers.host, tiers.disk, tiers.b):
        for k in t.keys(toks, space):
            record = t.store.get(k.digest, toks[k.start : k.end])
            assert record is not None and record.namespace == space
    reopened = TieredStore(
        TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=0, pin_memory=False),
            disk=DiskStoreConfig(root=str(tiers.disk.store.disk.root), capacity_bytes=1 << 22),
        ),
        LOWER_FP.digest(),
    )
    key = tiers.disk.keys(toks, space)[0]
    record = reopened.disk.get(key.digest, toks[: key.end])
    assert record is not None and record.namespace == space
    reopened.close()


# --------------------------------------------------------------------- the gate
VOCAB = 100
SIGNER = MarkSigner("secret")
CONFIG = PicConfig(min_chunk_tokens=2, max_chunks=3)
IDS = list(range(10, 30))


def req(custom: dict[str, Any], extra: str | None = None, salt: str | None = None) -> Any:
    """A stand-in for SGLang's ``Req``: its extra_key and cache_salt as the scheduler's
    ``Req.__init__`` leaves them (an empty salt is None there)."""
    return SimpleNamespace(
        rid="r1",
        origin_input_ids=IDS,
        sampling_params=SimpleNamespace(custom_params=custom),
        extra_key=extra,
        cache_salt=salt or None,
    )


def signed(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    marks = encode(PromptLayout.from_spans(len(IDS), [[0, 5], [5, 12]]), overrides or {})
    return {**marks, MAC_KEY: SIGNER.sign(IDS, marks)}


def test_the_gate_fixes_the_namespace_from_extra_key_and_cache_salt(metrics: PicMetrics) -> None:
    gate = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, marks=MARKS)
    seen = {}
    for extra, salt in [(None, None), ("tenant-A", None), (None, "tenant-A"), ("k", "s")]:
        r = req(signed(), extra, salt)
        assert gate.admit(r) is None
        pending = MARKS.get(r.rid)
        assert pending.namespace == isolation_namespace(extra, salt)
        assert pending.readable == (pending.namespace,)
        seen[(extra, salt)] = pending.namespace
    assert len(set(seen.values())) == 4 and seen[(None, None)] == DEFAULT_NAMESPACE
    # The prefix tree's namespace still holds the client's key after ours.
    r = req(signed(), "tenant-A")
    gate.admit(r)
    assert r.extra_key.endswith("|tenant-A")


def test_a_namespace_forged_into_signed_marks_is_not_honoured(metrics: PicMetrics) -> None:
    """Raw fields of ours beside valid marks (``sgl_pic_namespace``: another tenant's) make
    the request run exact, as any other internal field a client sends."""
    gate = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, marks=MARKS)
    forged = {**signed(), "sgl_pic_namespace": isolation_namespace(None, "victim")}
    r = req(forged, None, "attacker")
    assert gate.admit(r) is None
    assert r.rid not in MARKS
    assert all(not k.startswith("sgl_pic") for k in r.sampling_params.custom_params)


def test_the_public_scope_is_read_only_where_the_server_shares_one(metrics: PicMetrics) -> None:
    ask = signed({PUBLIC_SCOPE_OPTION: True})
    # No sharing by default: asking is refused with a clear error.
    closed = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, marks=MARKS)
    r = req(ask, None, "tenant-B")
    err = closed.admit(r)
    assert err is not None and "public" in err and r.rid not in MARKS
    # Where the operator names "corpus", a request asking reads it after its own ...
    policy = TenantPolicy.from_names(["corpus"])
    opened = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, tenants=policy, marks=MARKS)
    r = req(ask, None, "tenant-B")
    assert opened.admit(r) is None
    pending = MARKS.get(r.rid)
    own = isolation_namespace(None, "tenant-B")
    assert pending.namespace == own and pending.readable[0] == own
    assert set(pending.readable[1:]) == {
        isolation_namespace(None, "corpus"),
        isolation_namespace("corpus", None),
    }
    # ... and one not asking reads its own only.
    r = req(signed(), None, "tenant-B")
    assert opened.admit(r) is None and MARKS.get(r.rid).readable == (own,)


def test_public_namespaces_come_from_the_settings() -> None:
    assert tenant_policy(SimpleNamespace()).public == frozenset()
    policy = tenant_policy(SimpleNamespace(public_namespaces="corpus, docs"))
    assert policy == TenantPolicy.from_names(["corpus", "docs"])
    with pytest.raises(ValueError):
        TenantPolicy.from_names([" padded"])


def test_public_chunks_hit_across_tenants_only_through_the_public_scope() -> None:
    """The operator's corpus, stored by a request in the public namespace, serves tenant
    B when B reads the public scope; B's own chunks never reach the corpus or A."""
    table = ChunkNodeTable(FakeAllocator(256), DEVICE_FP, SEG, 256)
    policy = TenantPolicy.from_names(["corpus"])
    corpus = isolation_namespace(None, "corpus")
    a, b = isolation_namespace(None, "A"), isolation_namespace(None, "B")
    doc, secret = (1, 2, 3, 4, 5), (9, 8, 7, 6, 5)
    assert table.insert(doc, None, corpus)
    assert table.insert(secret, None, b)

    def found(tokens: tuple[int, ...], own: str, public: bool) -> bool:
        return any(table.match(tokens, ns) for ns in policy.readable(own, public))

    assert found(doc, b, True) and found(doc, a, True)
    assert not found(doc, b, False)
    assert not found(secret, a, True) and found(secret, b, False)
