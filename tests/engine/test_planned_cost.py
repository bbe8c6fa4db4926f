"""The planned cost of a chunked request, estimated before its batch (no SGLang): where
chunks are held, read without touching them; the rows phase 1, phase 2 and the signal
passes run, as the planner's own classification and selection count them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending, encoding_context
from sgl_pic.core.spans import PicRequest
from sgl_pic.engine import planner
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.planned_cost import PlannedCost, TierPresence
from sgl_pic.engine.planner import ChunkLookup, RequestPlan
from sgl_pic.keys import ModelFingerprint
from sgl_pic.layout import PromptLayout
from sgl_pic.registry import POLICIES
from sgl_pic.rope import default_inv_freq
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.support.fakes import FakeAllocator, chunk_data

FP = ModelFingerprint(model_id="test-model", dtype="float32")
PRE = ModelFingerprint(model_id="test-model", dtype="float32", pre_rope=True)
SEG, LAYERS, HEADS, DIM = 8, 4, 2, 8
INV_FREQ = default_inv_freq(DIM, 10000.0)
# Three chunks of 20 tokens, then 6 tokens of question: 66 tokens.
SPANS = [[0, 20], [20, 40], [40, 60]]
N = 66


def ids(seed: int = 0) -> tuple[int, ...]:
    return tuple(1000 * seed + i for i in range(N))


def pending(tokens: tuple[int, ...], readable: tuple[str, ...] = ("",)) -> Pending:
    request = PicRequest(PromptLayout.from_spans(N, SPANS), {})
    return Pending(request, tokens, readable[0], readable)


def table(held: list[tuple[int, ...]], namespace: str = "") -> ChunkNodeTable:
    t = ChunkNodeTable(FakeAllocator(512), FP, SEG, 512)
    for chunk in held:
        assert t.insert(chunk, None, namespace) is not None
    return t


@pytest.fixture
def lower(tmp_path: Path) -> Iterator[LowerTiers]:
    cfg = TieredStoreConfig(
        host=HostStoreConfig(capacity_bytes=1 << 22, pin_memory=False),
        disk=DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 22),
    )
    store = TieredStore(cfg, PRE.digest())
    yield LowerTiers(store, PRE, SEG, INV_FREQ)
    store.close()


def put(lt: LowerTiers, tokens: tuple[int, ...]) -> None:
    c = chunk_data(0, len(tokens), LAYERS, HEADS, DIM, INV_FREQ)
    assert lt.put_chunk(list(tokens), c.pre_k, c.v, c.ranking) > 0


def test_presence_reads_every_tier_without_touching_it(lower: LowerTiers) -> None:
    toks = ids()
    a, b, c = (toks[s:e] for s, e in SPANS)
    nodes = table([a])
    put(lower, c)
    lower.store.flush()
    # c leaves host memory: it is on disk only; b is stored after, in host memory.
    lower.store.host.evict(1 << 30)
    put(lower, b)
    presence = TierPresence(nodes, lower)
    before = [(n.hits, n.last_access) for n in nodes._nodes.values()]
    stats = lower.store.tier_stats()
    assert presence.tier(a, ("",)) == "device"
    assert presence.tier(b, ("",)) == "host"
    assert presence.tier(c, ("",)) == "disk"
    assert presence.tier(toks[60:], ("",)) is None
    # No access counted, nothing promoted or moved.
    assert [(n.hits, n.last_access) for n in nodes._nodes.values()] == before
    assert lower.store.tier_stats() == stats


def test_presence_looks_only_in_the_readable_namespaces() -> None:
    toks = ids()
    nodes = table([toks[0:20]], namespace="tenant-b")
    presence = TierPresence(nodes)
    assert presence.tier(toks[0:20], ("tenant-a",)) is None
    assert presence.tier(toks[0:20], ("tenant-a", "tenant-b")) == "device"


def test_a_warm_request_costs_its_selection_and_question() -> None:
    toks = ids()
    nodes = table([toks[s:e] for s, e in SPANS])
    est = PlannedCost(TierPresence(nodes), LAYERS).estimate(
        pending(toks), PicConfig(policy="cachetune", cachetune_r=0.25), 0
    )
    # Every chunk held: nothing encoded; cachetune recomputes ceil(0.25 * 20) = 5 rows of
    # each chunk, plus the 6 question rows (the last among them).
    assert est.encoded == 0 and est.reused == 60
    assert est.computed == 3 * 5 + 6
    assert est.cost == 21 and est.extend == N


def test_a_cold_request_costs_its_encoding_too_but_never_more_than_its_extend() -> None:
    toks = ids()
    presence = TierPresence(table([toks[0:20]]))
    config = PicConfig(policy="cachetune", cachetune_r=0.25)
    est = PlannedCost(presence, LAYERS).estimate(pending(toks), config, 0)
    assert est.encoded == 40 and est.reused == 20
    assert est.computed == 3 * 5 + 6
    assert est.cost == 40 + 21
    cold = PlannedCost(TierPresence(table([])), LAYERS).estimate(
        pending(toks), PicConfig(policy="cachetune", cachetune_r=1.0 - 1e-9), 0
    )
    assert cold.encoded == 60 and cold.cost == N  # 60 + 66 rows, capped at the extend


def test_exact_configs_cost_their_extend() -> None:
    toks = ids()
    presence = TierPresence(table([toks[s:e] for s, e in SPANS]))
    for config in (
        PicConfig(policy="full_recompute"),
        PicConfig(cachetune_r=1.0, policy="cachetune"),
    ):
        assert PlannedCost(presence, LAYERS).estimate(pending(toks), config, 10).cost == N - 10


def test_the_device_prefix_is_free_and_a_chunk_it_cuts_is_encoded_whole_without_a_copy() -> None:
    toks = ids()
    # Chunk 0 has no stored copy; the prefix ends at 12, inside it.
    presence = TierPresence(table([toks[20:40], toks[40:60]]))
    config = PicConfig(policy="full_reuse")
    est = PlannedCost(presence, LAYERS).estimate(pending(toks), config, 12)
    assert est.extend == N - 12
    # Chunk 0 encoded whole by phase 1 (its rows past the prefix then reused), the
    # question's 6 rows computed; chunks 1 and 2 reused whole.
    assert est.encoded == 20 and est.computed == 6 and est.reused == 40
    # With a stored copy, the cut chunk's rows past the prefix are reused.
    warm = TierPresence(table([toks[s:e] for s, e in SPANS]))
    est = PlannedCost(warm, LAYERS).estimate(pending(toks), config, 12)
    assert est.computed == 6 and est.reused == 8 + 40 and est.encoded == 0


def test_signal_passes_count_by_the_layers_they_run() -> None:
    toks = ids()
    presence = TierPresence(table([toks[s:e] for s, e in SPANS]))
    blend = PlannedCost(presence, LAYERS).estimate(pending(toks), PicConfig(policy="cacheblend"), 0)
    # CacheBlend's deviation runs every row past the prefix through layers 0 and 1.
    assert blend.signals == N * 2 / LAYERS
    qa = PlannedCost(presence, LAYERS).estimate(
        pending(toks), PicConfig(policy="query_aware", qa_layers=1), 0
    )
    # The probe runs the question's rows through qa_layers layers.
    assert qa.signals == 6 * 1 / LAYERS
    assert (
        PlannedCost(presence, LAYERS).estimate(pending(toks), PicConfig(policy="epic"), 0).signals
        == 0
    )


def test_reused_rows_count_at_the_assembly_weight() -> None:
    toks = ids()
    presence = TierPresence(table([toks[s:e] for s, e in SPANS]))
    config = PicConfig(policy="full_reuse")
    free = PlannedCost(presence, LAYERS).estimate(pending(toks), config, 0)
    paid = PlannedCost(presence, LAYERS, assembly_weight=0.1).estimate(pending(toks), config, 0)
    assert paid.cost == free.cost + 6  # 60 reused rows at 0.1


def test_calibrated_r_of_the_slowest_tier_is_used(lower: LowerTiers) -> None:
    toks = ids()
    nodes = table([toks[0:20], toks[20:40]])
    put(lower, toks[40:60])
    ratios = {"device": 0.1, "host": 0.5, "disk": 0.5}
    est = PlannedCost(TierPresence(nodes, lower), LAYERS, ratios).estimate(
        pending(toks), PicConfig(policy="cachetune"), 0
    )
    assert est.computed == 3 * 10 + 6  # r = 0.5 (host), not the server's 0.15


@pytest.mark.parametrize("prefix", [0, 24, 4])
@pytest.mark.parametrize("policy", POLICIES.names())
def test_the_count_is_what_the_policy_recomputes_whatever_the_signals(
    policy: str, prefix: int
) -> None:
    """The estimate runs the policy over stand-in signals; the batch runs it over real
    ones. Registered policies choose as many rows either way; where the device prefix cuts
    a chunk (a held one at 4, a missed one, encoded whole, at 24), the estimate is the most
    any signal can make them compute."""
    toks = ids()
    held = [toks[0:20], toks[40:60]]
    presence = TierPresence(table(held))
    config = PicConfig(policy=policy)
    est = PlannedCost(presence, LAYERS).estimate(pending(toks), config, prefix)
    gen = torch.Generator().manual_seed(7)
    counts = set()
    for _ in range(5):
        plan = RequestPlan(0, 0, prefix, pending(toks), config)

        def look(s: int, e: int) -> ChunkLookup:
            hit = toks[s:e] in held
            return ChunkLookup("device" if hit else None, torch.rand(e - s, generator=gen))

        planner.classify(plan, look, lambda s, e, k: look(s, e))
        counts.add(int(planner.select(plan, Random(gen)).numel()))
    if prefix == 0:
        assert counts == {est.computed}
    else:
        assert max(counts) <= est.computed


class Random:
    """``planner.Signals`` of random scores."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def deviation(self, plan: RequestPlan) -> torch.Tensor:
        return torch.rand(plan.num_tokens, generator=self.gen)

    def query_attention(self, plan: RequestPlan) -> torch.Tensor:
        return torch.rand(plan.num_tokens, generator=self.gen)


def test_bad_arguments_are_refused() -> None:
    presence = TierPresence(table([]))
    with pytest.raises(ValueError, match="num_layers"):
        PlannedCost(presence, 0)
    with pytest.raises(ValueError, match="assembly_weight"):
        PlannedCost(presence, LAYERS, assembly_weight=2.0)
    with pytest.raises(ValueError, match="device prefix"):
        PlannedCost(presence, LAYERS).estimate(pending(ids()), PicConfig(), N)


def test_a_waiting_request_is_not_hashed_or_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked at every scheduling pass while it waits, a request's chunk keys and selection
    are computed once; where its chunks are held is looked up each time."""
    toks = ids()
    nodes = table([toks[0:20]])
    est = PlannedCost(TierPresence(nodes), LAYERS)
    marks = pending(toks)
    config = PicConfig(policy="cachetune", cachetune_r=0.25)
    calls = {"keys": 0, "select": 0}
    keys, select = nodes.keys, planner.select

    def counted_keys(*a: object, **k: object) -> object:
        calls["keys"] += 1
        return keys(*a, **k)  # type: ignore[arg-type]

    def counted_select(*a: object, **k: object) -> object:
        calls["select"] += 1
        return select(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(nodes, "keys", counted_keys)
    monkeypatch.setattr(planner, "select", counted_select)
    first = est.estimate(marks, config, 0)
    assert calls == {"keys": 3, "select": 1}
    assert est.estimate(marks, config, 0) == first
    assert calls == {"keys": 3, "select": 1}
    # A chunk stored meanwhile is found, and the plan made again for the new hits.
    assert nodes.insert(toks[20:40], None) is not None
    hashed = calls["keys"]  # the insert's own
    warmer = est.estimate(marks, config, 0)
    assert calls == {"keys": hashed, "select": 2}
    assert warmer.encoded == first.encoded - 20 and warmer.cost < first.cost
    # Another prefix or config is another plan.
    est.estimate(marks, config, 5)
    est.estimate(marks, PicConfig(policy="epic"), 0)
    assert calls["select"] == 4


def test_what_is_kept_is_bounded() -> None:
    presence = TierPresence(table([]), memo_chunks=2)
    est = PlannedCost(presence, LAYERS, memo_plans=1)
    for seed in range(3):
        est.estimate(pending(ids(seed)), PicConfig(policy="full_reuse"), 0)
    assert len(presence._digests) == 2 and len(est._plans) == 1


def test_a_context_computed_with_each_miss_is_counted_and_its_keys_are_its_own() -> None:
    """Under ``chunk_context="first_chunk"`` a miss past the first chunk is encoded after
    the prompt's tokens through it: counted with the miss where phase 1 computes them (no
    device prefix holds them), not where the prefix does; and a chunk held encoded alone
    is no hit for a request that needs it encoded after its first chunk."""
    toks = ids()
    config = PicConfig(policy="cachetune", cachetune_r=0.25, chunk_context="first_chunk")
    request = PicRequest(PromptLayout.from_spans(N, SPANS), {})
    encoding = encoding_context(config, request.layout, toks)
    end, context, contents = encoding
    assert end == SPANS[0][1] and len(context) == 64 and len(contents) == 1  # one segment of 256
    marks = Pending(request, toks, "", ("",), encoding)
    assert marks.context_of(SPANS[0][0]) == "" and marks.context_of(SPANS[1][0]) == context
    alone = table([toks[s:e] for s, e in SPANS])
    est = PlannedCost(TierPresence(alone), LAYERS).estimate(marks, config, 0)
    assert est.encoded == 40 + 2 * end  # two misses, each computed with the context
    warm = PlannedCost(TierPresence(alone), LAYERS).estimate(marks, config, end)
    assert warm.encoded == 40  # the device prefix holds the context
    nodes = table([toks[s:e] for s, e in SPANS[:1]])
    for s, e in SPANS[1:]:
        assert nodes.insert(toks[s:e], None, "", context) is not None
    assert PlannedCost(TierPresence(nodes), LAYERS).estimate(marks, config, 0).encoded == 0
