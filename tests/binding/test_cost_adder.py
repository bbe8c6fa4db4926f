"""Chunked requests charged their planned cost by SGLang's own ``PrefillAdder`` (CPU, no
server).

Every test drives SGLang's real ``PrefillAdder.add_one_req`` (as ``PlannedCostAdder`` and
as SGLang ships it) over SGLang's real ``Req``, ``UnifiedRadixCache``, token-to-KV
allocator and pools, with a published ``ServerArgs``; the chunk nodes sit on the same
allocator. A chunked request's marks are admitted as the gate admits them
(``AdmittedMarks``)."""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import inspect
from array import array
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_pic.binding import hooks
from sgl_pic.binding.cost_adder import (
    PlannedCharges,
    PlannedCostAdder,
    adder_factory,
    planned_charges,
)
from sgl_pic.binding.runtime import set_current
from sgl_pic.config import PicConfig
from sgl_pic.core.gate import AdmittedMarks, Pending
from sgl_pic.core.spans import PicRequest
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.planned_cost import PlannedCost, TierPresence
from sgl_pic.engine.rank_agreement import RankAgreement
from sgl_pic.keys import ModelFingerprint
from sgl_pic.layout import PromptLayout
from tests.support.sglang_cache import cache_params, kv_pool_and_allocator, published_server_args

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
FP = ModelFingerprint(model_id="test-model", dtype="float32")
POOL, CHUNK, MAX_PREFILL, LAYERS = 8192, 256, 1024, 28
SERVER = PicConfig(policy="cachetune", cachetune_r=0.1)


@pytest.fixture(scope="module", autouse=True)
def server_args(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """SGLang's ServerArgs for a tiny Llama, published as this process's config (what the
    adder reads through ``get_schedule()`` and ``get_exec()``); unpublished afterwards."""
    with published_server_args(tmp_path_factory.mktemp("model"), CONFIG) as args:
        yield args


class Env:
    """One scheduler's cache side: SGLang's pools, allocator and radix cache, the chunk
    nodes on the same allocator, the admitted marks, and the requests made so far."""

    def __init__(self) -> None:
        _, self.alloc = kv_pool_and_allocator(POOL)
        self.cache = UnifiedRadixCache(cache_params(self.alloc, 1, 16, 4096))
        self.nodes = ChunkNodeTable(self.alloc, FP, 64, 4096)
        self.marks = AdmittedMarks()
        self.seed = 0

    def charges(self) -> PlannedCharges:
        estimator = PlannedCost(TierPresence(self.nodes), LAYERS)
        return PlannedCharges(self.marks, SERVER, estimator)

    def adder(self, planned: bool = True, chunk: int | None = CHUNK) -> PrefillAdder:
        args = (1, self.cache, self.alloc, None, 0.5, MAX_PREFILL, chunk)
        if planned:
            return PlannedCostAdder(*args, planned=self.charges())
        return PrefillAdder(*args)

    def req(
        self,
        chunks: int,
        question: int = 20,
        chunk_len: int = 100,
        marked: bool = True,
        held: bool = True,
        rid: str | None = None,
    ) -> Req:
        """A prompt of ``chunks`` chunks and a question, as SGLang queues it (its prefix
        matched); with ``marked``, its marks admitted; with ``held``, its chunks in the
        chunk nodes."""
        self.seed += 1
        n = chunks * chunk_len + question
        tokens = tuple(self.seed * 10_000 + i for i in range(n))
        spans = [[i * chunk_len, (i + 1) * chunk_len] for i in range(chunks)]
        rid = rid or f"r{self.seed}"
        if marked:
            request = PicRequest(PromptLayout.from_spans(n, spans), {})
            self.marks.put(rid, Pending(request, tokens))
        if held:
            for s, e in spans:
                assert self.nodes.insert(tokens[s:e], None) is not None
        sp = SamplingParams(max_new_tokens=16)
        sp.normalize(None)
        req = Req(rid, "", array("q", tokens), sp)
        req.init_next_round_input(self.cache)
        return req

    def cost(self, req: Req) -> int:
        cost = self.charges().cost(req, req.prefix_len)
        assert cost is not None
        return cost


def add(adder: PrefillAdder, req: Req) -> AddReqResult:
    return adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)


@pytest.fixture
def env() -> Env:
    return Env()


def test_a_long_chunked_request_with_a_small_planned_cost_is_taken_whole(env: Env) -> None:
    req = env.req(6)  # 620 tokens, past the 256-token chunk budget
    cost = env.cost(req)
    assert cost < CHUNK < len(req.origin_input_ids)
    adder = env.adder()
    offset = adder.memory_budget.total_offset
    assert add(adder, req) == AddReqResult.CONTINUE
    assert adder.can_run_list == [req] and adder.new_chunked_req is None
    assert req.extend_len == 620
    # The compute budgets pay the planned cost only.
    assert adder.rem_chunk_tokens == CHUNK - cost
    assert adder.rem_input_tokens == MAX_PREFILL - cost
    # Memory pays every token, as SGLang reserves a whole admission of 620 tokens (with
    # chunked prefill off, the one way it takes them whole).
    plain = Env()
    whole = plain.adder(planned=False, chunk=None)
    plain_offset = whole.memory_budget.total_offset
    add(whole, plain.req(6, marked=False))
    assert (
        adder.memory_budget.total_offset - offset == whole.memory_budget.total_offset - plain_offset
    )


def test_a_plain_request_is_split_as_sglang_splits_it(env: Env) -> None:
    ours, theirs = env.adder(), env.adder(planned=False)
    for adder in (ours, theirs):
        req = env.req(6, marked=False)
        assert add(adder, req) == AddReqResult.OTHER
        assert adder.new_chunked_req is req and req.extend_len == CHUNK
    assert ours.rem_chunk_tokens == theirs.rem_chunk_tokens == 0
    assert ours.rem_input_tokens == theirs.rem_input_tokens == MAX_PREFILL - CHUNK
    assert ours.memory_budget.total_offset == theirs.memory_budget.total_offset


def test_sglang_alone_splits_the_same_chunked_request(env: Env) -> None:
    """What the adder changes: SGLang's own adder cuts the cheap request at 256."""
    req = env.req(6)
    adder = env.adder(planned=False)
    add(adder, req)
    assert adder.new_chunked_req is req and req.extend_len == CHUNK


def test_a_chunked_request_whose_cost_does_not_fit_is_split_and_charged_its_piece(
    env: Env,
) -> None:
    req = env.req(6, held=False)  # cold: every chunk is encoded
    assert env.cost(req) > CHUNK
    adder = env.adder()
    assert add(adder, req) == AddReqResult.OTHER
    assert adder.new_chunked_req is req and req.extend_len == CHUNK
    assert adder.rem_chunk_tokens == 0 and adder.rem_input_tokens == MAX_PREFILL - CHUNK


def test_a_batch_holds_as_many_chunked_requests_as_their_cost_allows(env: Env) -> None:
    reqs = [env.req(2) for _ in range(4)]  # 220 tokens each
    cost = env.cost(reqs[0])
    ours = env.adder()
    for r in reqs:
        assert add(ours, r) == AddReqResult.CONTINUE
    assert ours.can_run_list == reqs and ours.new_chunked_req is None
    assert ours.rem_chunk_tokens == CHUNK - 4 * cost
    # SGLang's adder takes one whole and cuts the next at the 36 tokens left.
    theirs = env.adder(planned=False)
    fresh = [env.req(2) for _ in range(4)]
    for r in fresh:
        if add(theirs, r) != AddReqResult.CONTINUE:
            break
    assert len(theirs.can_run_list) == 2 and theirs.new_chunked_req is fresh[1]
    assert fresh[1].extend_len == CHUNK - 220


def test_rows_stay_within_max_prefill_tokens(env: Env) -> None:
    """A batch whose chunk path fails runs every row as plain prefill: its rows stay under
    SGLang's bound on a prefill batch (--max-prefill-tokens), whatever their cost."""
    adder = env.adder()
    taken = []
    for _ in range(6):
        r = env.req(4)  # 420 tokens
        res = add(adder, r)
        taken.append(r)
        if res != AddReqResult.CONTINUE:
            break
    rows = sum(r.extend_len for r in adder.can_run_list)
    assert rows <= MAX_PREFILL
    # Two whole (840 rows); the third only gets what keeps rows + budget within 1024.
    assert [r.extend_len for r in adder.can_run_list[:2]] == [420, 420]
    assert len(adder.can_run_list) == 3 and adder.new_chunked_req is taken[2]
    assert rows + adder.rem_chunk_tokens <= MAX_PREFILL


def test_requests_the_chunk_path_does_not_take_whole_are_charged_as_sglang_does(
    env: Env,
) -> None:
    charges = env.charges()
    changed = env.req(6)
    changed.origin_input_ids = array("q", list(changed.origin_input_ids[:-1]) + [7])
    changed.full_untruncated_fill_ids = changed.origin_input_ids
    assert charges.cost(changed, 0) is None
    logprobs = env.req(6)
    logprobs.return_logprob, logprobs.logprob_start_len = True, 0
    assert charges.cost(logprobs, 0) is None
    last_only = env.req(6)
    last_only.return_logprob, last_only.logprob_start_len = True, -1
    assert charges.cost(last_only, 0) is not None
    resumed = env.req(6)
    resumed.output_ids.extend([1, 2])
    resumed.refresh_fill_ids()
    assert charges.cost(resumed, 0) is None
    assert charges.cost(env.req(6, marked=False), 0) is None
    embeds = env.req(6)
    embeds.input_embeds = [[0.0]]
    assert charges.cost(embeds, 0) is None
    # And SGLang's adder cuts such a request where it would.
    adder = env.adder()
    req = env.req(6)
    req.return_logprob, req.logprob_start_len = True, 0
    add(adder, req)
    assert adder.new_chunked_req is req and req.extend_len == CHUNK


def test_an_estimate_that_fails_charges_the_extend(env: Env) -> None:
    class Broken:
        def estimate(self, *a: Any) -> Any:
            raise RuntimeError("boom")

    charges = PlannedCharges(env.marks, SERVER, Broken())  # type: ignore[arg-type]
    req = env.req(6)
    adder = PlannedCostAdder(
        1, env.cache, env.alloc, None, 0.5, MAX_PREFILL, CHUNK, planned=charges
    )
    add(adder, req)
    assert adder.new_chunked_req is req and req.extend_len == CHUNK


def test_no_chunked_prefill_keeps_sglangs_batches(env: Env) -> None:
    """With chunked prefill off, --max-prefill-tokens is both the compute and the row
    bound: the adder takes what SGLang takes."""
    ours, theirs = env.adder(chunk=None), env.adder(planned=False, chunk=None)
    for adder in (ours, theirs):
        reqs = [env.req(4) for _ in range(4)]
        for r in reqs:
            if add(adder, r) != AddReqResult.CONTINUE:
                break
    assert [r.extend_len for r in ours.can_run_list] == [r.extend_len for r in theirs.can_run_list]
    assert ours.rem_input_tokens == theirs.rem_input_tokens


# ------------------------------------------------------------------ wiring into SGLang


def test_sglang_builds_its_adder_through_the_hooked_factory() -> None:
    """The surface this relies on, as SGLang 0.5.23 has it: the scheduler asks
    ``get_prefill_adder_class()`` for the class it builds each pass, and ``add_one_req``
    selects, then commits, through the two methods ``PlannedCostAdder`` extends."""
    src = inspect.getsource(Scheduler._get_new_batch_prefill_raw)
    assert "self.get_prefill_adder_class()(" in src
    assert Scheduler.get_prefill_adder_class(SimpleNamespace()) is PrefillAdder
    add_src = inspect.getsource(PrefillAdder.add_one_req)
    assert "self._select_prefill_admission(" in add_src
    assert "self._commit_prefill_admission(req, admission, mamba_gap_reserve)" in add_src
    select = inspect.signature(PrefillAdder._select_prefill_admission)
    assert list(select.parameters) == [
        "self",
        "req",
        "total_tokens",
        "host_hit_length",
        "swa_host_hit_length",
        "truncation_align_size",
        "has_chunked_req",
    ]
    assert all(
        p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(select.parameters.values())[2:]
    )


def test_the_hook_hands_sglang_the_planned_adder_only_where_reuse_is_on(env: Env) -> None:
    original = Scheduler.get_prefill_adder_class
    factory = hooks.PrefillAdderFactory()
    previous = set_current(None)
    try:
        assert factory.hook(original, SimpleNamespace()) is PrefillAdder
        set_current(SimpleNamespace(executor=None))  # type: ignore[arg-type]
        assert factory.hook(original, SimpleNamespace()) is PrefillAdder
        first = SimpleNamespace(executor=Executor(env), marks=env.marks)
        set_current(first)  # type: ignore[arg-type]
        made = factory.hook(original, SimpleNamespace())
        # Called as the scheduler calls it: SGLang's arguments, positional and by name.
        adder = made(1, env.cache, env.alloc, None, 0.5, MAX_PREFILL, CHUNK, 0, 0, max_prefill_bs=0)
        assert type(adder) is PlannedCostAdder and adder.planned is not None
        req = env.req(6)
        assert add(adder, req) == AddReqResult.CONTINUE and req.extend_len == 620
        # The same charges (and what their estimator keeps) from pass to pass ...
        again = factory.hook(original, SimpleNamespace())(
            1, env.cache, env.alloc, None, 0.5, 64, 64
        )
        assert again.planned is adder.planned
        # ... until the process has another runtime.
        set_current(SimpleNamespace(executor=Executor(env), marks=env.marks))  # type: ignore[arg-type]
        other = factory.hook(original, SimpleNamespace())(
            1, env.cache, env.alloc, None, 0.5, 64, 64
        )
        assert other.planned is not adder.planned
        # With tensor parallelism each rank's estimate reads its own tiers: SGLang's adder,
        # so that every rank's scheduler forms the same batches.
        shared = Executor(env)
        shared.ranks = RankAgreement(lambda t: t)
        set_current(SimpleNamespace(executor=shared, marks=env.marks))  # type: ignore[arg-type]
        assert factory.hook(original, SimpleNamespace()) is PrefillAdder
    finally:
        set_current(previous)

    class Other(PrefillAdder):
        pass

    assert adder_factory(Other, env.charges()) is Other  # another plugin's adder is left alone


def test_without_charges_the_adder_is_sglangs(env: Env) -> None:
    adder = PlannedCostAdder(1, env.cache, env.alloc, None, 0.5, MAX_PREFILL, CHUNK)
    req = env.req(6)
    add(adder, req)
    assert adder.new_chunked_req is req and req.extend_len == CHUNK


class Executor:
    """The parts of ``ChunkExecutor`` ``planned_charges`` reads (checked against a real one
    in ``test_planned_charges_read_a_real_executor``)."""

    def __init__(self, env: Env) -> None:
        self.nodes = env.nodes
        self.lower = None
        self.kv = SimpleNamespace(num_layers=LAYERS)
        self.select = SimpleNamespace(ratios=None)
        self.config = SERVER
        self.ranks = RankAgreement()  # one rank


def test_planned_charges_read_a_real_executor(tmp_path: Path) -> None:
    """``planned_charges`` over a real ``ChunkExecutor``: its chunk nodes, lower tiers,
    layer count, calibrated ratios and server config."""
    from sgl_pic.binding.phases import PhaseRunner
    from sgl_pic.binding.runtime import PicRuntime
    from sgl_pic.engine.executor import ChunkExecutor
    from sgl_pic.engine.kv_access import KVAccess
    from sgl_pic.engine.rotation import ModelRope
    from sgl_pic.rope import default_inv_freq
    from tests.support.fakes import FakeAllocator, FakePool

    assert planned_charges(SimpleNamespace(executor=None)) is None
    pool = FakePool(64, 3, 2, 8)
    nodes = ChunkNodeTable(FakeAllocator(64), FP, 8, 64)
    kv = KVAccess(pool, 3, ModelRope.plain(default_inv_freq(8, 10000.0), max_positions=64))
    req_pool = ReqToTokenPool(2, 64, "cpu", False)
    phases = PhaseRunner(SimpleNamespace(), req_pool.req_to_token, None, req_pool)
    ratios = {"device": 0.3}
    executor = ChunkExecutor(SERVER, nodes, kv, NoMetrics(), phases, ratios=ratios)
    marks = AdmittedMarks()
    runtime = PicRuntime(SimpleNamespace(marks=marks), NoMetrics(), executor, phases)  # type: ignore[arg-type]
    charges = planned_charges(runtime)
    assert charges is not None
    assert charges.marks is marks and charges.server_config is SERVER
    est = charges.estimator
    assert isinstance(est.presence, TierPresence) and est.presence.nodes is nodes
    assert est.presence.lower is None and est.num_layers == 3 and est.ratios is ratios
    # The stand-in the hook tests use reads what the real executor has.
    stand_in = Executor(Env())
    for name in vars(stand_in):
        assert hasattr(executor, name), name
    assert executor.kv.num_layers == 3 and executor.select.ratios is ratios


class NoMetrics:
    """Takes every metric update and keeps none (one ``PicMetrics`` per process)."""

    def __getattr__(self, name: str) -> NoMetrics:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> NoMetrics:
        return self
