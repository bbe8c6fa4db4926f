"""Ranks that agree: two real ``torch.distributed`` (gloo) processes, each one tensor-
parallel rank running the real ``ChunkExecutor`` (the host-sync harness's worker, with host
and disk tiers), a fault injected on one rank only.

Every forward of the decoder stack first gathers its signature (tokens, their sum, their
positions' sum) from both ranks and fails on a mismatch, as a TP model's collectives would
pair up wrong work; phase 1's CacheTune ranking all-reduces over the ranks as on a server.
A rank that took another path is caught there, or waits in a collective until gloo's
timeout; the parent gives up on the pair after ``WAIT_S``, so a hang fails the test.

- a chunk one rank deleted (an order of the shared log that rank read first) is a miss on
  both ranks, though the other still holds it on the device;
- a disk record that fails its checksum on one rank while phase 2 loads it (the same
  tiers on both otherwise): both ranks finish the forward, then both retry, and the chunk
  is a miss on both;
- a miss rank 1's store admission defers and rank 0's would store: deferred on both;
- a chunk on the device on one rank and in host memory on the other: both plan it as a
  host hit (CacheTune's r of the slower tier), and recompute the same positions;
- the control: the same tiers with each rank deciding alone (as before the agreement)
  diverge, so the faults above do set the ranks apart.
"""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import queue
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sgl_pic.binding.tp_collectives import tp_max
from sgl_pic.config import PicConfig
from sgl_pic.engine.deleter import Deleter
from sgl_pic.engine.executor import ChunkExecutor
from sgl_pic.engine.layer_feed import FeedTimeout
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.rank_agreement import ChunkVote, PeerFailed, RankAgreement
from sgl_pic.keys import ModelFingerprint
from sgl_pic.store.admission import StoreAdmission
from sgl_pic.store.deletion import Deletion, segment_contents
from sgl_pic.store.disk.store import DiskStoreConfig
from sgl_pic.store.format import read_header
from sgl_pic.store.host import HostStoreConfig
from sgl_pic.store.tiered import TieredStore, TieredStoreConfig
from tests.engine.test_host_syncs import INV_FREQ, SEGMENT, NoMetrics, Server, chunk, prompts

WAIT_S = 90.0  # for the pair of ranks, imports included
GLOO_TIMEOUT_S = 10.0  # one collective's longest wait: a rank left alone fails after it
FP_PRE = ModelFingerprint(model_id="test-model", dtype="float32", pre_rope=True)
# CacheTune's r per tier: a chunk planned as a host hit recomputes more of its tokens
# than one planned as a device hit, so ranks that label one chunk apart run phase 2 over
# different tokens.
RATIOS = {"device": 0.1, "host": 0.5, "disk": 0.5}


class Diverged(AssertionError):
    """The ranks ran different forwards at the same step."""


class Tally:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, by: int = 1) -> None:
        self.n += by


class Counted(NoMetrics):
    """Keeps the plan stats each batch records and the retries; drops the rest."""

    def __init__(self) -> None:
        self.recorded: list[Any] = []
        self.retries = Tally()

    def record(self, stats: Any) -> None:
        self.recorded.append(stats)


def tp_sum(t: torch.Tensor) -> torch.Tensor:
    out = t.as_subclass(torch.Tensor).clone()
    dist.all_reduce(out)
    return out


class Log:
    """This rank's read of the shared store's deletion log, as ``TieredStore.sync_deletions``
    hands it over: orders applied to host and disk, then returned for the chunk nodes."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.pending: list[Deletion] = []

    def sync_deletions(self) -> tuple[Deletion, ...]:
        out, self.pending = tuple(self.pending), []
        for d in out:
            self.store.host.remove_matching(d)
            self.store.disk.remove_matching(d)
        return out


class Rank(Server):
    """One rank's worker: chunk nodes, host and disk tiers of its own, the executor with
    the gloo collectives; every forward checked against the other rank's."""

    def __init__(self, root: Path, agree: bool) -> None:
        super().__init__("cachetune")
        config = TieredStoreConfig(
            host=HostStoreConfig(capacity_bytes=1 << 24, pin_memory=False),
            disk=DiskStoreConfig(root=str(root), capacity_bytes=1 << 26),
            promote_on_get=False,
            promote_on_get_layers=False,
        )
        self.store = TieredStore(config, FP_PRE.digest())
        self.metrics = Counted()
        self.log = Log(self.store)
        nodes = self.executor.nodes
        self.executor = ChunkExecutor(
            PicConfig(policy="cachetune"),
            nodes,
            self.kv,
            self.metrics,
            self.phases,
            lower=LowerTiers(self.store, FP_PRE, SEGMENT, INV_FREQ),
            ratios=RATIOS,
            reduce=tp_sum,
            sync_deletions=Deleter(nodes, store=self.log).sync,
            admission=StoreAdmission("always"),
            # The server's own collective (``binding.tp_collectives``), over a real SGLang TP group.
            ranks=RankAgreement(tp_max if agree else None),
        )
        self.forwards = 0

    def stack(self, ids: torch.Tensor, pos: torch.Tensor, fb: Any) -> torch.Tensor:
        sig = torch.tensor([ids.numel(), int(ids.sum()), int(pos.sum())])
        both = [torch.zeros_like(sig) for _ in range(2)]
        dist.all_gather(both, sig)
        if not torch.equal(both[0], both[1]):
            raise Diverged(f"forward {self.forwards}: {both[0].tolist()} vs {both[1].tolist()}")
        self.forwards += 1
        return super().stack(ids, pos, fb)

    def batch(self, chunk_order: list[int]) -> dict[str, Any]:
        """One batch of one prompt; what both ranks must agree on."""
        self.metrics.recorded.clear()
        out = self.run(prompts([chunk_order]))
        (stats,) = self.metrics.recorded
        return {
            "stats": stats._asdict() | {"selection_seconds": 0.0},
            "recomputed_rows": (out != 0).any(dim=1).as_subclass(torch.Tensor).tolist(),
            "retries": self.metrics.retries.n,
            "forwards": self.forwards,
        }

    def stored(self, order: list[int]) -> None:
        """Runs ``order`` once (every chunk a miss, stored) and waits for the disk."""
        self.run(prompts([order]))
        self.store.flush()

    def drop_nodes(self, chunks: list[int]) -> None:
        for c in chunks:
            self.executor.nodes.delete(Deletion(contents=segment_contents(chunk(c), SEGMENT)))


def one_rank_deleted(r: Rank, rank: int) -> dict[str, Any]:
    r.stored([1, 2, 3])
    if rank == 1:
        r.log.pending.append(Deletion(contents=segment_contents(chunk(2), SEGMENT)))
    return r.batch([3, 1, 2])


def one_rank_record_fails(r: Rank, rank: int) -> dict[str, Any]:
    r.stored([1, 2, 3])
    # Device nodes and host copies gone: both ranks read every chunk from disk, where
    # rank 1's record of chunk 2 has a payload that fails its checksum (its header still
    # checks out, so the lookup finds it).
    r.drop_nodes([1, 2, 3])
    r.store.host.evict(1 << 40)
    if rank == 1:
        key = r.executor.lower.keys(chunk(2))[0].digest
        path = Path(r.store.disk.path_of(key))
        at = read_header(path).data_offset + 100
        with open(path, "r+b") as f:
            f.seek(at)
            data = f.read(16)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in data))
    return r.batch([2, 3, 1])


def one_rank_feed_times_out(r: Rank, rank: int) -> dict[str, Any]:
    """Both ranks read every chunk from disk; rank 1's read of layer 1 hangs past the
    feed's timeout. Neither raises mid-forward: after phase 2 both give the batch up."""
    r.stored([1, 2, 3])
    r.drop_nodes([1, 2, 3])
    r.store.host.evict(1 << 40)
    r.executor.phase2.forwards.feed_timeout_s = 0.5
    if rank == 1:
        loader = r.executor.lower.loader
        fetch = loader.fetch_layer

        def slow(placements: Any, layer: int) -> Any:
            if layer == 1:
                time.sleep(2.0)
            return fetch(placements, layer)

        loader.fetch_layer = slow
    try:
        r.batch([2, 3, 1])
    except FeedTimeout:
        return {"given_up": True, "forwards": r.forwards}
    return {"given_up": False, "forwards": r.forwards}


def tiers_differ(r: Rank, rank: int) -> dict[str, Any]:
    r.stored([1, 2, 3])
    if rank == 1:
        r.drop_nodes([1, 2, 3])  # rank 1 finds them in host memory, rank 0 on the device
    return r.batch([1, 3, 2])


def admission_apart(r: Rank, rank: int) -> dict[str, Any]:
    """Rank 1's store admission defers first sights, rank 0's stores every miss."""
    if rank == 1:
        r.executor.admission = StoreAdmission("second_sight")
    return r.batch([1, 2, 3])


def one_rank_raises(r: Rank, rank: int) -> dict[str, Any]:
    """Rank 1's selection raises an error of its own (between forwards), through the
    runtime as a server runs it: rank 1 tells rank 0 (``RankAgreement.fail``), which learns
    of it at its next collective (phase 2's forward: ``PeerFailed``). Both run the batch as
    plain prefill; the next batch is served with reuse on both."""
    from types import SimpleNamespace

    from sgl_pic.binding.runtime import PicRuntime
    from sgl_pic.core.gate import AdmittedMarks

    r.stored([1, 2, 3])
    marks = AdmittedMarks()
    runtime = PicRuntime(SimpleNamespace(marks=marks), r.metrics, r.executor, r.phases)  # type: ignore[arg-type]
    fell_back: list[bool] = []
    select = r.executor.select.run

    def failing_select(*args: Any) -> Any:
        if rank == 1 and not fell_back:
            raise RuntimeError("injected: rank 1's selection failed")
        return select(*args)

    def through_runtime(stack: Any, ids: torch.Tensor, live: Any, handoff: Any) -> Any:
        r.executor.forward = forward  # type: ignore[method-assign]  # what the runtime calls
        for rid, pending in handoff.items():
            marks.put(rid, pending)
        reqs = [
            SimpleNamespace(rid=k, origin_input_ids=list(p.token_ids)) for k, p in handoff.items()
        ]
        runtime.prepare_batch(SimpleNamespace(reqs=reqs))
        pos = torch.cat([torch.arange(n) for n in live.extend_seq_lens_cpu]).to(ids.device)
        out = runtime.on_extend(stack, ids, pos, live)
        fell_back.append(out is None)
        return stack(ids, pos, live) if out is None else out  # as the decoder stack does

    r.executor.select.run = failing_select  # type: ignore[method-assign]
    forward, r.executor.forward = r.executor.forward, through_runtime  # type: ignore[method-assign]
    try:
        r.run(prompts([[3, 1, 2]]))
        r.executor.forward = forward  # type: ignore[method-assign]
        after = r.batch([2, 1, 3])
    finally:
        r.executor.forward = forward  # type: ignore[method-assign]
    return {
        "fell_back": fell_back,
        "after_hits": after["stats"]["device_hits"],
        "forwards": r.forwards,
    }


SCENARIOS = {
    "admission_apart": (admission_apart, True),
    "one_rank_deleted": (one_rank_deleted, True),
    "one_rank_record_fails": (one_rank_record_fails, True),
    "one_rank_feed_times_out": (one_rank_feed_times_out, True),
    "tiers_differ": (tiers_differ, True),
    "one_rank_raises": (one_rank_raises, True),
    # Last: ranks that diverge leave the group out of step.
    "tiers_differ_unagreed": (tiers_differ, False),
}


def sglang_tp_group(rank: int) -> list[int]:
    """Builds SGLang's own ``GroupCoordinator`` over both ranks, as its model runner does
    (a gloo CPU group beside the device one), hands it out where the scheduler's
    ``get_tp_group`` would (this process only), and returns the plugin's maximum of
    [rank, 5 - rank, 7] over it."""
    from sglang.srt import distributed
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    group = GroupCoordinator(
        [[0, 1]],
        rank,
        "gloo",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="tp",
    )
    distributed.get_tp_group = lambda: group
    return tp_max(torch.tensor([rank, 5 - rank, 7])).tolist()


def rank_main(rank: int, port: int, root: str, out: Any) -> None:
    """One rank: every scenario in order, each on fresh tiers; its results or error."""
    results: dict[str, Any] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
        results["tp_max"] = sglang_tp_group(rank)
        for name, (scenario, agree) in SCENARIOS.items():
            r = Rank(Path(root) / f"{name}-{rank}", agree)
            try:
                results[name] = scenario(r, rank)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                results[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
                break
            finally:
                r.store.close()
    finally:
        out.put((rank, results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Both ranks' results per scenario; fails if the pair does not finish in time."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    root = str(tmp_path_factory.mktemp("ranks"))
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, root, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, results = out.get(timeout=WAIT_S)
            got[rank] = results
    except queue.Empty:
        pytest.fail(f"the ranks did not finish in {WAIT_S:g} s (a rank waits on the other)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return got


def agreed(ranks: dict[int, dict[str, Any]], name: str) -> dict[str, Any]:
    """The scenario's result, which must be the same on both ranks."""
    a, b = ranks[0].get(name), ranks[1].get(name)
    for r in (a, b):
        assert r is not None and "error" not in r, r and r.get("tb")
    assert a == b
    assert a is not None
    return a


def test_the_plugins_maximum_runs_over_sglangs_tp_group(ranks: dict) -> None:
    """``tp_max`` on SGLang's ``GroupCoordinator`` (its ``cpu_group``), the group
    ``tensor_model_parallel_all_reduce`` (``tp_sum``) also goes through."""
    import inspect

    from sglang.srt.distributed import communication_op

    assert "get_tp_group()" in inspect.getsource(communication_op.tensor_model_parallel_all_reduce)
    assert ranks[0]["tp_max"] == ranks[1]["tp_max"] == [1, 5, 7]


def test_a_chunk_one_rank_deleted_is_a_miss_on_both(ranks: dict) -> None:
    got = agreed(ranks, "one_rank_deleted")
    # Chunk 2: rank 0 still held it on the device; both encoded it afresh.
    assert got["stats"]["misses"] == 1 and got["stats"]["device_hits"] == 2
    assert got["retries"] == 0


def test_a_record_failing_mid_load_on_one_rank_makes_both_retry(ranks: dict) -> None:
    got = agreed(ranks, "one_rank_record_fails")
    assert got["retries"] == 1
    # The retry: chunk 2 a miss on both; the others disk hits on both.
    assert got["stats"]["misses"] == 1
    assert got["stats"]["disk_hits"] == 2 and got["stats"]["device_hits"] == 0


def test_a_feed_timing_out_on_one_rank_makes_both_give_the_batch_up(ranks: dict) -> None:
    # The same forwards on both ranks, then both raise FeedTimeout (the runtime runs the
    # batch as exact prefill on every rank).
    assert agreed(ranks, "one_rank_feed_times_out")["given_up"] is True


def test_an_error_on_one_rank_sends_both_to_plain_prefill_together(ranks: dict) -> None:
    """The same forwards on both ranks (each checked against the other's), both fall back,
    and the group stays in step: the next batch reuses every chunk on both."""
    got = agreed(ranks, "one_rank_raises")
    assert got["fell_back"] == [True] and got["after_hits"] == 3


def test_a_miss_is_stored_only_where_every_rank_would(ranks: dict) -> None:
    got = agreed(ranks, "admission_apart")
    assert got["stats"]["deferred"] == 3 and got["stats"]["misses"] == 0


def test_tiers_that_differ_between_ranks_give_one_plan(ranks: dict) -> None:
    got = agreed(ranks, "tiers_differ")
    assert got["stats"]["host_hits"] == 3 and got["stats"]["device_hits"] == 0
    assert got["stats"]["misses"] == 0


def test_ranks_deciding_alone_diverge_on_the_same_tiers(ranks: dict) -> None:
    """The control: without the agreement (each rank its own lookups, as at 919fa3f) the
    same faults put the ranks on different forwards."""
    for rank in (0, 1):
        got = ranks[rank].get("tiers_differ_unagreed")
        assert got is not None and "Diverged" in got.get("error", ""), got


def test_one_rank_agrees_with_itself() -> None:
    alone = RankAgreement()
    votes = [ChunkVote("host", True), ChunkVote(None, True), ChunkVote("device", False)]
    assert alone.agree_chunks(votes) == votes
    assert alone.all_of([True, False]) == [True, False]
    assert alone.any_of(True) and not alone.any_of(False)


class OtherRank:
    """Stands in for the collective: the other rank's vector for each call in turn, as
    ``torch.maximum`` with this rank's. Every agreement starts with ``proceed``, where a
    rank that has not failed sends 0."""

    def __init__(self, *answers: list[int]) -> None:
        self.answers = list(answers)
        self.sent: list[list[int]] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.sent.append(t.tolist())
        return torch.maximum(t, torch.tensor(self.answers.pop(0)))


def test_the_slowest_tier_and_any_miss_win() -> None:
    """``agree_chunks`` over a stand-in for the collective: the other rank holds the three
    chunks on disk, on the device and (unranked) in host memory."""
    # Tier codes (device 0, host 1, disk 2), then 1 where that rank has no ranking.
    with_them = OtherRank([0], [2, 0, 1, 0, 0, 1])
    mine = [ChunkVote("device", True), ChunkVote(None, True), ChunkVote("host", True)]
    assert RankAgreement(with_them).agree_chunks(mine) == [
        ChunkVote("disk", True),
        ChunkVote(None, True),
        ChunkVote("host", False),
    ]
    # Store admission: the other rank would store the first miss, defer the second.
    both = RankAgreement(OtherRank([0], [0, 1], [0], [0, 1]))
    assert both.all_of([True, True]) == [True, False]
    assert both.all_of([False, True]) == [False, False]


def test_a_rank_that_failed_meets_the_others_next_collective() -> None:
    """A failed rank's ``fail`` is the other ranks' next ``proceed``: there they raise
    ``PeerFailed`` instead of running the collective it will never join."""
    failed = OtherRank([1])
    with pytest.raises(PeerFailed):
        RankAgreement(failed).all_of([True])
    assert failed.sent == [[0]]  # the agreement's own vector was never sent
    mine = OtherRank([0])
    RankAgreement(mine).fail()
    assert mine.sent == [[1]]
    alone = RankAgreement()
    alone.proceed()
    alone.fail()  # one rank: nothing to tell
