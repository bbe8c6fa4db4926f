"""The chunk path's largest temporary does not grow with the chunk: phase 1's store of a
32k-token miss (its ranking, its chunk nodes, its host-tier records, the request's rows)
and the query probe over that prompt hold at most 1.5x what they hold for a 4k-token miss.

What is measured: with torch's CPU memory profiler, every allocation made during the call
and freed before it returns (a temporary) is tracked by address, and the figure is the
most bytes such allocations held at once. Allocations still held when the call returns
are not temporaries and are left out: the KV pool (allocated before), the host tier's
records and the chunk nodes' rankings (storage), the ranking returned, the probe's scores.
Both misses exceed the staging bound many times over (``STAGING`` against tens of MiB of
KV), so the bound, not the chunk, must set the figure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from sgl_pic.engine.query_probe import QueryProbe
from tests.engine.test_chunk_store import make_miss
from tests.store.helpers import hold_disk_writes

LAYERS, HEADS, KV_HEADS, DIM, SEGMENT = 2, 4, 2, 64, 256
QUESTION = 16
STAGING = 2 << 20
SHORT, LONG = 4096, 32768


def temporary_peak(fn: Callable[[], object]) -> int:
    """The most bytes held at once by allocations ``fn`` made and freed before returning
    (module doc), from the profiler's allocation events (address, size; frees negative)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
    events.sort()
    # An allocation is a temporary when a free of its address follows it.
    freed: set[int] = set()
    temporary: list[bool] = [False] * len(events)
    for i in range(len(events) - 1, -1, -1):
        _, ptr, size = events[i]
        if size < 0:
            freed.add(ptr)
        elif ptr in freed:
            temporary[i] = True
            freed.discard(ptr)
    live: dict[int, int] = {}
    now = most = 0
    for (_, ptr, size), temp in zip(events, temporary, strict=True):
        if size > 0 and temp:
            live[ptr] = size
            now += size
            most = max(most, now)
        elif size < 0 and ptr in live:
            now -= live.pop(ptr)
    return most


def chunk_path_peak(tmp: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """(store, probe, KV bytes of the miss): the temporary peaks of phase 1's store of an
    n-token miss with the host tier on, and of a probe of both layers over the prompt."""
    miss = make_miss(
        tmp, n, staging_bytes=STAGING, layers=LAYERS, heads=KV_HEADS, dim=DIM, segment=SEGMENT
    )
    assert miss.lower is not None
    held = hold_disk_writes(monkeypatch)  # no disk writer allocating during the measure
    try:
        store = temporary_peak(lambda: miss.phase1._store(miss.plan, 0, n, miss.enc))
        tokens = miss.plan.pending.token_ids[:n]
        assert miss.lower.match(tokens) is not None  # every segment kept on the host
    finally:
        held.release.set()
        miss.lower.store.close()
    g = torch.Generator().manual_seed(1)
    prompt = n + QUESTION
    probe = QueryProbe(
        miss.pool,
        miss.request[:prompt],
        torch.arange(QUESTION),
        torch.arange(n, prompt),
        LAYERS,
        staging_bytes=STAGING,
    )
    attn = [
        SimpleNamespace(tp_q_head_num=HEADS, qk_head_dim=DIM, layer_id=i, scaling=DIM**-0.5)
        for i in range(LAYERS)
    ]
    qs = [torch.randn(QUESTION, HEADS * DIM, generator=g) for _ in range(LAYERS)]

    def run_probe() -> None:
        for layer in range(LAYERS):
            probe.after_attention(layer, attn[layer], qs[layer])

    probe_peak = temporary_peak(run_probe)
    assert probe._device_total().sum() == pytest.approx(LAYERS * HEADS * QUESTION, rel=1e-4)
    return store, probe_peak, 2 * LAYERS * n * KV_HEADS * DIM * 4


def test_the_largest_temporary_of_a_32k_miss_is_within_1_5x_of_a_4k_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = chunk_path_peak(tmp_path / "short", SHORT, monkeypatch)
    long = chunk_path_peak(tmp_path / "long", LONG, monkeypatch)
    print("store, probe, KV bytes: 4k", short, "32k", long)
    assert short[2] >= 4 * STAGING  # both misses are large against the bound
    assert max(long[:2]) <= 1.5 * max(short[:2]), (short, long)
    # Each step on its own, too: neither grows with the chunk.
    assert long[0] <= 1.5 * short[0] and long[1] <= 1.5 * short[1], (short, long)
