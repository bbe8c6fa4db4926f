"""Host syncs of the chunk path: a chunked batch run through the real ``ChunkExecutor``
(lookups, device-hit copies, phase 1, the query probe, selection, phase 2) on the CPU, with
every read of device data by the host counted.

There is no GPU here, so "device data" is marked: SGLang's tensors (the pool's K/V
buffers, the request table, the allocator's slots, the live batch's tensors) and the
decoder stack's outputs are ``Dev`` tensors, and everything computed from them stays one
(torch's subclass propagation). A host read of a ``Dev`` tensor is what would wait for the
GPU: ``tolist``, ``item``, ``cpu``, ``numpy``, ``bool``/``int``/``float``, and ops whose
output size depends on the data (``nonzero``, ``unique``, ``masked_select``, boolean
indexing), as ``torch.cuda.set_sync_debug_mode`` reports on a GPU. Host-side planning
tensors (made from Python lists, as SGLang's own ``*_cpu`` fields) are not counted.

The other way waits too: a copy of host data to the device from pageable memory
(``torch.tensor(..., device=)``, ``to``/``copy_`` onto the device) blocks the host until the
stream has run up to it. Such copies by the device-side code are counted as ``h2d``, except
``non_blocking`` ones from pinned memory. The device is mocked as a CUDA one
(``device_copy.pinnable``), and ``pin_memory`` marks its result pinned instead of pinning.
"""

# ruff: noqa: E402 - sglang imports need the CPU stubs active first

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

from sgl_pic.binding.cpu_env import activate_cpu_stubs

activate_cpu_stubs()

import torch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from torch.overrides import TorchFunctionMode

from sgl_pic.binding.phase_batch import build_phase_batch
from sgl_pic.binding.phases import PhaseRunner
from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.core.runs import SubRequest
from sgl_pic.core.spans import PicRequest
from sgl_pic.engine import device_copy, planner, query_probe
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.executor import ChunkExecutor
from sgl_pic.engine.kv_access import KVAccess
from sgl_pic.engine.rotation import ModelRope
from sgl_pic.keys import ModelFingerprint
from sgl_pic.layout import PromptLayout
from sgl_pic.rope import default_inv_freq
from tests.support.fakes import FakeAllocator, FakePool

LAYERS, HEADS, KV_HEADS, DIM, HIDDEN = 2, 4, 2, 16, 32
CHUNK, QUESTION = 24, 6
SEGMENT = 8  # tokens per chunk node
INV_FREQ = default_inv_freq(DIM, 10000.0)

_SYNC_METHODS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.unique,
    torch.unique,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.equal,
    torch.allclose,
}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _bool_index(args: tuple[Any, ...]) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class Dev(torch.Tensor):
    """A tensor that stands for GPU memory: host reads of it are counted in ``syncs``
    while ``counting``."""

    syncs: ClassVar[Counter[str]] = Counter()
    counting: ClassVar[bool] = False

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if cls.counting and (func in _SYNC_METHODS or (func in _INDEXING and _bool_index(args))):
            cls.syncs[getattr(func, "__name__", str(func))] += 1
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.cpu and isinstance(out, torch.Tensor):
            return out.as_subclass(torch.Tensor)  # copied to the host: host data from here
        return out


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(Dev)


# Modules whose tensors made on a named device are device tensors on a GPU (the pool's
# or the live batch's device). Selection policies and the planner name a device only to
# follow their inputs' (``device=x.device``), which propagation covers.
DEVICE_MODULES = (
    "sgl_pic/engine/executor.py",
    "sgl_pic/engine/forwards.py",
    "sgl_pic/engine/lookup.py",
    "sgl_pic/engine/phase1.py",
    "sgl_pic/engine/chunk_store.py",
    "sgl_pic/engine/signals.py",
    "sgl_pic/engine/select.py",
    "sgl_pic/engine/phase2.py",
    "sgl_pic/engine/kv_access.py",
    "sgl_pic/binding/phases.py",
    "sgl_pic/binding/phase_batch.py",
    "sgl_pic/engine/device_copy.py",
    "sgl_pic/engine/query_probe.py",
    "sgl_pic/engine/layer_feed.py",
    "sgl_pic/binding/attention.py",
    "sgl_pic/ops/",
)


# Functions outside those modules that the server runs on device data.
DEVICE_FUNCTIONS = (
    ("sgl_pic/selection/query_aware.py", "question_attention"),
    ("sgl_pic/selection/query_aware.py", "_masked_logits"),
    ("sgl_pic/selection/cachetune.py", "__init__"),  # ``LowPassEnergy``: phase 1's ranking
)


def _sgl_pic_caller() -> Any:
    """The innermost sgl_pic frame calling into torch (None: none)."""
    frame = sys._getframe(2)
    while frame is not None and "sgl_pic/" not in frame.f_code.co_filename:
        frame = frame.f_back
    return frame


def _is_device_code(frame: Any) -> bool:
    if frame is None:
        return False
    name = frame.f_code.co_filename
    return any(m in name for m in DEVICE_MODULES) or any(
        m in name and frame.f_code.co_name == f for m, f in DEVICE_FUNCTIONS
    )


_COPY_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _names_device(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` puts its result on a named device (a device, or ``to(other)``). A
    literal ``"cpu"`` is the host, whatever the mocked device is."""
    named = [kwargs.get("device")]
    if func is torch.Tensor.to:
        named += [a for a in args[1:] if isinstance(a, torch.device | str)]
        named += [a.device for a in args[1:] if isinstance(a, torch.Tensor)]
    named = [d for d in named if d is not None]
    return bool(named) and not any(d == "cpu" for d in named)


def _pinned_async(src: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A ``non_blocking`` copy from pinned memory: the host goes on at once."""
    non_blocking = kwargs.get("non_blocking", False) or any(a is True for a in args[1:])
    return bool(non_blocking) and getattr(src, "_pinned", False)


def _blocking_h2d(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``func`` copies host data onto the device and waits for it (module doc)."""
    if func in _COPY_FACTORIES:
        src = args[0] if args else kwargs.get("data")
        return _names_device(func, args, kwargs) and not isinstance(src, Dev)
    if func is torch.Tensor.to:
        src = args[0]
        return (
            not isinstance(src, Dev)
            and _names_device(func, args, kwargs)
            and not _pinned_async(src, args, kwargs)
        )
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        return (
            isinstance(dst, Dev)
            and isinstance(src, torch.Tensor)
            and not isinstance(src, Dev)
            and not _pinned_async(src, args, kwargs)
        )
    return False


class DeviceFactories(TorchFunctionMode):
    """Tensors the device-side modules make on a named device (a factory or ``to``
    naming one) are device data too; host planning tensors name none. Their blocking
    host-to-device copies are counted (``h2d``); ``pin_memory`` marks its copy pinned."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            pinned = args[0].clone()  # no pinned memory without CUDA: a marked copy
            pinned._pinned = True
            return pinned
        caller = _sgl_pic_caller()
        device_code = _is_device_code(caller)
        if Dev.counting and device_code and _blocking_h2d(func, args, kwargs):
            where = f"{caller.f_code.co_filename.rsplit('sgl_pic/', 1)[-1]}:{caller.f_lineno}"
            Dev.syncs[f"h2d {getattr(func, '__name__', func)} {where}"] += 1
        out = func(*args, **kwargs)
        names_device = kwargs.get("device") is not None or (
            func is torch.Tensor.to and any(isinstance(a, torch.device | str) for a in args)
        )
        if names_device and type(out) is torch.Tensor and device_code:
            return out.as_subclass(Dev)
        return out


@contextmanager
def counting() -> Iterator[Counter[str]]:
    Dev.syncs = Counter()
    Dev.counting = True
    saved = getattr(device_copy, "pinnable", None)
    # The mocked device is a CUDA one: pin for it (where ``to_device`` looks it up).
    device_copy.pinnable = lambda device: True
    try:
        with DeviceFactories():
            yield Dev.syncs
    finally:
        Dev.counting = False
        if saved is None:
            del device_copy.pinnable
        else:
            device_copy.pinnable = saved


class DevAllocator(FakeAllocator):
    """The fake allocator handing out device slots, as SGLang's does."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        slots = super().alloc(need_size)
        return None if slots is None else dev(slots)

    def free(self, free_index: torch.Tensor) -> None:
        # The fake's own bookkeeping reads the slots; SGLang's allocator does not.
        saved, Dev.counting = Dev.counting, False
        try:
            super().free(free_index.as_subclass(torch.Tensor))
        finally:
            Dev.counting = saved


class NoMetrics:
    """Takes every metric update the executor makes and keeps none: Prometheus names are
    global, and one ``PicMetrics`` per process is all a test run may register."""

    def __getattr__(self, name: str) -> NoMetrics:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> NoMetrics:
        return self


class PlainBackend:
    """An attention backend that plans nothing: the stack below does not attend."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        pass


class Server:
    """The pieces of one worker the executor needs, device data marked ``Dev``."""

    def __init__(self, policy: str) -> None:
        self.pool = FakePool(4096, LAYERS, KV_HEADS, DIM)
        self.pool.k_buffer = [dev(b) for b in self.pool.k_buffer]
        self.pool.v_buffer = [dev(b) for b in self.pool.v_buffer]
        self.alloc = DevAllocator(4000)
        self.req_pool = ReqToTokenPool(32, 512, "cpu", False)
        self.req_pool.req_to_token = dev(self.req_pool.req_to_token)
        fp = ModelFingerprint(model_id="test-model", dtype="float32")
        nodes = ChunkNodeTable(self.alloc, fp, SEGMENT, 2048)
        self.kv = KVAccess(self.pool, LAYERS, ModelRope.plain(INV_FREQ, max_positions=512))
        # On a GPU pool ``copy_rotated`` gathers every row (the CPU's slice runs read the
        # indices on the host); take that path here too.
        self.kv.per_layer_copies = False
        self.phases = PhaseRunner(PlainBackend(), self.req_pool.req_to_token, None, self.req_pool)
        self.executor = ChunkExecutor(
            PicConfig(policy=policy), nodes, self.kv, NoMetrics(), self.phases
        )
        self.attn = [
            SimpleNamespace(tp_q_head_num=HEADS, qk_head_dim=DIM, layer_id=i, scaling=DIM**-0.5)
            for i in range(LAYERS)
        ]

    def stack(self, ids: torch.Tensor, pos: torch.Tensor, fb: Any) -> torch.Tensor:
        """A decoder stack's footprint: each layer's hooks, its K/V written to the batch's
        slots, queries handed to the attention hook; no host reads of its own."""
        x = (ids.to(torch.float32)[:, None] + pos.to(torch.float32)[:, None]) * 0.01
        for layer in range(LAYERS):
            self.phases.layer_start(layer)
            k = torch.sin(x + layer).expand(-1, KV_HEADS * DIM).reshape(-1, KV_HEADS, DIM)
            self.pool.k_buffer[layer][fb.out_cache_loc] = k
            self.pool.v_buffer[layer][fb.out_cache_loc] = torch.cos(k)
            q = torch.sin(x - layer).expand(-1, HEADS * DIM).contiguous()
            self.phases.attention_end(layer, self.attn[layer], q)
            self.phases.layer_end(layer)
        return x.expand(-1, HIDDEN).contiguous()

    def run(self, prompts: list[tuple[list[list[int]], list[int]]]) -> torch.Tensor:
        """One extend batch of chunked prompts (chunks, question), none with a device
        prefix; # [tokens, hidden]."""
        rows = self.req_pool.alloc_rows(len(prompts))
        handoff: dict[str, Pending] = {}
        assert rows is not None
        ids: list[int] = []
        lens: list[int] = []
        locs: list[torch.Tensor] = []
        for b, (chunks, question) in enumerate(prompts):
            toks = [t for c in chunks for t in c] + question
            layout = PromptLayout.from_lengths([len(c) for c in chunks], len(question))
            rid = f"r{b}"
            handoff[rid] = Pending(PicRequest(layout, {}), tuple(toks))
            slots = self.alloc.alloc(len(toks))
            assert slots is not None
            self.req_pool.req_to_token[rows[b], : len(toks)] = slots.to(torch.int32)
            ids += toks
            lens.append(len(toks))
            locs.append(slots)
        live = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(prompts),
            input_ids=dev(torch.tensor(ids)),
            req_pool_indices=dev(torch.tensor(rows, dtype=torch.int64)),
            seq_lens=dev(torch.tensor(lens)),
            out_cache_loc=torch.cat(locs),
            seq_lens_sum=sum(lens),
            extend_prefix_lens_cpu=[0] * len(prompts),
            extend_seq_lens_cpu=lens,
            # SGLang's host copy of the rows, as ``ForwardBatch.init_new`` sets it.
            req_pool_indices_cpu=torch.tensor(rows, dtype=torch.int64),
            rids=[f"r{b}" for b in range(len(prompts))],
        )
        out = self.executor.forward(self.stack, live.input_ids, live, handoff)
        assert out is not None and out.shape == (sum(lens), HIDDEN)
        self.req_pool.free_rows(rows)
        return out


def chunk(i: int) -> list[int]:
    return list(range(100 * i + 1, 100 * i + 1 + CHUNK))


def question(i: int) -> list[int]:
    return list(range(5000 + 10 * i, 5000 + 10 * i + QUESTION))


def prompts(chunk_orders: list[list[int]]) -> list[tuple[list[list[int]], list[int]]]:
    return [([chunk(c) for c in order], question(i)) for i, order in enumerate(chunk_orders)]


def syncs_of(server: Server, batch: list[tuple[list[list[int]], list[int]]]) -> Counter[str]:
    with counting() as syncs:
        server.run(batch)
    print(len(batch), "request(s):", dict(syncs))
    return Counter(syncs)


def reads(syncs: Counter[str]) -> int:
    return sum(n for name, n in syncs.items() if not name.startswith("h2d"))


def copies(syncs: Counter[str]) -> int:
    return sum(n for name, n in syncs.items() if name.startswith("h2d"))


# Host reads a chunked batch makes, each named by where it is. The executor takes its rows
# from SGLang's host copy (``planner.pool_rows``), so it reads none of them from the device.
HIT_COPY = 1  # ``copy_rotated``'s one slot check, every device hit of the batch at once
# Per chunk phase 1 stores: its read, one write per chunk node, its re-rotated write, and
# its CacheTune ranking, read once for the plan, the chunk node and the tiers.
PER_MISS = 1 + -(-CHUNK // SEGMENT) + 1 + 1
# Per batch, query_aware: one read of every request's probe scores (``host_scores``).
# cachetune reads nothing more: hit chunks' rankings are kept on the host.
PER_BATCH = {"query_aware": 1, "cachetune": 0}

# Blocking host-to-device copies. Phase batches (``build_phase_batch``) and the query
# probe (``QueryProbe``, ``question_attention``) make none: what they send goes in one
# non-blocking copy from pinned memory per batch or probe.
NO_BLOCKING_COPIES = (
    "binding/phases.py",
    "binding/phase_batch.py",
    "engine/query_probe.py",
    "selection/query_aware.py",
)
# Those left elsewhere, bounded so that they do not grow with the hits: the device hits'
# RoPE frequencies and re-rotation (``kv_access``, ``ops``), the probe pass's token ids
# (executor), and per missed chunk up to four (its RoPE frequencies and writes, phase 1's
# token ids).
HIT_H2D = 3
PER_BATCH_H2D = {"query_aware": 1, "cachetune": 0}
PER_MISS_H2D = 4


def test_the_modules_said_to_make_no_blocking_copy_exist() -> None:
    """The no-blocking-copy check matches these paths; a module moved away from one would
    make it pass without looking."""
    import sgl_pic

    package = Path(sgl_pic.__file__).parent
    assert all((package / name).is_file() for name in NO_BLOCKING_COPIES)


@pytest.mark.parametrize("policy", ["query_aware", "cachetune"])
def test_host_syncs_of_a_chunked_batch_do_not_grow_with_its_hits(policy: str) -> None:
    """Device hits cost one host read per batch, however many chunks and requests reuse
    them (``copy_rotated``), and the signals one more (``PER_BATCH``); a missed chunk's
    storage is per chunk (``PER_MISS``). Blocking host-to-device copies: none from the
    phase batches or the probe, the others bounded the same way."""
    server = Server(policy)
    batch, batch_h2d = PER_BATCH[policy], PER_BATCH_H2D[policy]
    runs = [
        (prompts([[0, 1]]), batch + 2 * PER_MISS, batch_h2d + 2 * PER_MISS_H2D),
        (prompts([[2, 3, 4]]), batch + 3 * PER_MISS, batch_h2d + 3 * PER_MISS_H2D),
        (prompts([[1, 0]]), HIT_COPY + batch, HIT_H2D + batch_h2d),
        (
            prompts([[1, 0, 2], [3, 4, 0], [2, 1, 4], [4, 3, 2]]),
            HIT_COPY + batch,
            HIT_H2D + batch_h2d,
        ),
    ]
    for prompt_batch, max_reads, max_copies in runs:
        syncs = syncs_of(server, prompt_batch)
        assert reads(syncs) <= max_reads
        assert copies(syncs) <= max_copies
        assert not [name for name in syncs if any(m in name for m in NO_BLOCKING_COPIES)]


def test_a_phase_batch_reaches_the_device_in_one_non_blocking_copy() -> None:
    """``build_phase_batch`` sends its positions, rows, lengths and offsets together, from
    pinned memory; its fields are those the host lists describe."""
    server = Server("cachetune")
    rows = server.req_pool.alloc_rows(2)
    assert rows is not None
    live = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=dev(torch.zeros(4, dtype=torch.int64)),
        req_pool_indices=dev(torch.tensor(rows[:1], dtype=torch.int64)),
        seq_lens=dev(torch.tensor([4])),
        out_cache_loc=dev(torch.arange(4)),
        seq_lens_sum=4,
    )
    subs = [
        SubRequest(rows[0], 3, 2),
        SubRequest(rows[0], 7, 1),
        SubRequest(rows[1], 0, 4),
    ]
    with counting() as syncs:
        fb = build_phase_batch(
            live, subs, dev(torch.arange(7)), server.req_pool.req_to_token, None
        ).forward_batch
    assert not syncs
    assert fb.positions.tolist() == [3, 4, 7, 0, 1, 2, 3]
    assert fb.req_pool_indices.tolist() == [rows[0], rows[0], rows[1]]
    assert fb.seq_lens.tolist() == fb.orig_seq_lens.tolist() == [5, 8, 4]
    assert fb.seq_lens_cpu.tolist() == [5, 8, 4]
    assert fb.extend_prefix_lens.tolist() == [3, 7, 0]
    assert fb.extend_seq_lens.tolist() == [2, 1, 4]
    assert fb.extend_start_loc.tolist() == [0, 2, 3]
    assert fb.extend_seq_lens.dtype == fb.extend_prefix_lens.dtype == torch.int32
    assert fb.extend_start_loc.dtype == torch.int32
    assert fb.positions.dtype == fb.req_pool_indices.dtype == torch.int64
    assert fb.seq_lens.dtype == live.seq_lens.dtype
    assert fb.orig_seq_lens.data_ptr() != fb.seq_lens.data_ptr()
    server.req_pool.free_rows(rows)


def test_the_live_batch_carries_sglangs_host_copy_of_its_rows() -> None:
    """``planner.pool_rows`` reads ``req_pool_indices_cpu``: a field of SGLang's
    ForwardBatch, which ``init_new`` fills for extend batches from the schedule batch."""
    import dataclasses
    import inspect

    assert "req_pool_indices_cpu" in {f.name for f in dataclasses.fields(ForwardBatch)}
    assert "req_pool_indices_cpu=" in inspect.getsource(ForwardBatch.init_new)
    rows = dev(torch.tensor([3, 1]))
    live = SimpleNamespace(req_pool_indices=rows, req_pool_indices_cpu=torch.tensor([3, 1]))
    with counting() as syncs:
        assert planner.pool_rows(live) == [3, 1]
    assert not syncs


def test_the_probes_of_a_pass_reach_the_host_in_one_read() -> None:
    pool = FakePool(64, LAYERS, KV_HEADS, DIM)
    pool.k_buffer = [dev(torch.randn(b.shape)) for b in pool.k_buffer]
    attn = SimpleNamespace(tp_q_head_num=HEADS, qk_head_dim=DIM, layer_id=0, scaling=0.25)
    probes = []
    for n in (10, 14, 7):
        slots = dev(torch.randperm(63)[:n] + 1)
        probe = query_probe.QueryProbe(
            pool, slots, torch.tensor([0, 1]), torch.tensor([n - 2, n - 1]), 1
        )
        probe.after_attention(0, attn, dev(torch.randn(2, HEADS * DIM)))
        probes.append(probe)
    with counting() as syncs:
        together = query_probe.host_scores(probes)
    assert sum(syncs.values()) == 1
    for probe, scores in zip(probes, together, strict=True):
        assert type(scores) is torch.Tensor and torch.equal(scores, probe.scores)


def test_a_probe_scores_its_layers_without_a_sync() -> None:
    """A probe's rows and positions reach the device once, without blocking, and no layer
    copies or reads them again; its scores are ``question_attention``'s on host data."""
    from sgl_pic.selection.query_aware import question_attention

    pool = FakePool(64, LAYERS, KV_HEADS, DIM)
    pool.k_buffer = [dev(torch.randn(b.shape)) for b in pool.k_buffer]
    attn = [
        SimpleNamespace(tp_q_head_num=HEADS, qk_head_dim=DIM, layer_id=i, scaling=0.25)
        for i in range(LAYERS)
    ]
    slots = dev(torch.randperm(63)[:12] + 1)
    rows, pos = torch.tensor([1, 3, 4]), torch.tensor([5, 9, 11])
    qs = [dev(torch.randn(6, HEADS * DIM)) for _ in range(LAYERS)]
    with counting() as syncs:
        probe = query_probe.QueryProbe(pool, slots, rows, pos, LAYERS)
        for layer in range(LAYERS):
            probe.after_attention(layer, attn[layer], qs[layer])
    assert not syncs
    plain = slots.as_subclass(torch.Tensor)
    want = sum(
        question_attention(
            qs[i].as_subclass(torch.Tensor).reshape(6, HEADS, DIM)[rows],
            pool.k_buffer[i].as_subclass(torch.Tensor)[plain],
            pos,
            0.25,
        )
        for i in range(LAYERS)
    )
    assert torch.allclose(probe.scores, want, atol=1e-6)
