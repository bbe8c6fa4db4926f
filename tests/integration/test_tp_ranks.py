"""SGLang's own ``--tp-size 2`` on the CPU: two scheduler ranks, each with disk records of
its own (its shard of the heads), and a fault on one rank only. Both ranks must take one
path for the batch, or their collectives stall (the request would never answer).

SGLang binds each CPU rank to cores of its own (``SGLANG_CPU_OMP_THREADS_BIND``; without
it, one rank per NUMA node): the test needs two cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from sgl_pic.store.format import PREFIX_BYTES, SUFFIX, read_header
from tests.support.prompts import DOCS, body, chunked, ids
from tests.support.server import launch

pytestmark = pytest.mark.sglang

# Chunks only on disk: every reuse is a disk load, and records go there at once.
DISK_ONLY = ("--pic-device-cache-fraction", "0", "--pic-host-cache-mb", "0")
ANSWER_S = 240.0  # a stalled pair of ranks never answers


def rank_files(root: Path, name: str) -> list[Path]:
    """The record files of chunk ``name`` (one segment each): one per rank."""
    want = tuple(ids(DOCS[name] + "\n"))
    return [p for p in sorted(root.rglob("*" + SUFFIX)) if tuple(read_header(p).token_ids) == want]


def test_a_fault_on_one_rank_sends_both_down_one_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank-local faults. One rank's record of C is gone: a miss there only, so both ranks
    encode C. One rank's record of D has a payload failing its checksum, found while phase
    2 loads it: both ranks finish the forward, then retry together with D a miss. Rank 1's
    selection raises (an injected error, through an SGLang plugin of the test's own): both
    ranks run that batch as plain prefill, its answer is exact prefill's, and the next
    request reuses again. Each request answers; counts are summed over both ranks."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("SGLang's CPU tensor parallelism binds each rank to a core of its own")
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    trigger = tmp_path / "fault_on"
    fault_plugin(tmp_path / "plugin", trigger, monkeypatch)
    root = tmp_path / "disk"
    with launch("--tp-size", "2", *DISK_ONLY, "--pic-disk-cache-dir", str(root)) as s:
        first = s.send(body(*chunked(["A", "B", "C", "D"], "Which city is in Norway?")))
        assert first.delta["sgl_pic_chunk_misses_total"] == 8  # 4 chunks x 2 ranks
        files = {n: rank_files(root, n) for n in "ABCD"}
        assert all(len(f) == 2 for f in files.values()), files

        files["C"][0].unlink()
        gone = answer(s.url, s.metrics, ["C", "A"], "Which city is on the equator?")
        assert gone.get("sgl_pic_chunk_misses_total", 0) == 2  # C, on both ranks
        assert gone.get(DISK_HITS, 0) == 2  # A, on both ranks
        assert gone.get("sgl_pic_retries_total", 0) == 0

        damaged = files["D"][1]
        at = read_header(damaged).data_offset + 100
        assert at > PREFIX_BYTES
        with open(damaged, "r+b") as f:
            f.seek(at)
            data = f.read(16)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in data))
        bad = answer(s.url, s.metrics, ["D", "B"], "Where is the midnight sun?")
        assert bad.get("sgl_pic_retries_total", 0) == 2  # each rank retried, once
        assert bad.get("sgl_pic_chunk_misses_total", 0) == 2  # D, on both ranks
        assert bad.get(DISK_HITS, 0) == 2  # B, on both ranks
        for moved in (gone, bad):
            assert moved.get("sgl_pic_failures_total", 0) == 0
            assert moved.get("sgl_pic_fallbacks_total", 0) == 0

        question = "Which city sits where two rivers meet?"
        toks, spans = chunked(["B", "A"], question, f"Notes on {question}\n")
        trigger.touch()
        faulted = s.send(body(toks, spans))
        trigger.unlink()
        exact = s.send(body(toks, None)).out["output_ids"]  # sent second: no prefix to find
        assert faulted.delta["sgl_pic_failures_total"] == 2  # one on each rank
        assert faulted.out["output_ids"] == exact  # the batch ran as exact prefill
        after = answer(s.url, s.metrics, ["A", "B"], "Which city had wooden temples?")
        assert after.get(DISK_HITS, 0) == 4 and after.get("sgl_pic_failures_total", 0) == 0
        assert "injected fault on rank 1" in s.log_tail(2000)


FAULT_PLUGIN = """
import os


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sgl_pic.engine.select.Select.run", select, HookType.AROUND)


def select(original, *args, **kwargs):
    import torch.distributed as dist

    if os.path.exists({trigger!r}) and dist.is_initialized() and dist.get_rank() == 1:
        raise RuntimeError("injected fault on rank 1")
    return original(*args, **kwargs)
"""


def fault_plugin(where: Path, trigger: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang plugin (an entry point of a distribution on PYTHONPATH, found by SGLang's
    ``load_plugins`` in every process) whose hook makes rank 1's selection raise while
    ``trigger`` exists."""
    where.mkdir()
    (where / "sgl_pic_test_faults.py").write_text(FAULT_PLUGIN.format(trigger=str(trigger)))
    info = where / "sgl_pic_test_faults-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sgl-pic-test-faults\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nsgl_pic_test_faults = sgl_pic_test_faults:register\n"
    )
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(where), path])))


DISK_HITS = 'sgl_pic_tier_hits_total{tier="disk"}'


def answer(
    url: str, metrics: Callable[[], dict[str, float]], names: list[str], question: str
) -> dict[str, float]:
    """Sends the chunks behind a fresh header (no prefix of an earlier prompt); what the
    request moved in /metrics. Fails if the ranks do not answer within ``ANSWER_S``."""
    before = metrics()
    t0 = time.monotonic()
    toks, spans = chunked(names, question, f"Notes on {question}\n")
    r = requests.post(url + "/generate", json=body(toks, spans), timeout=ANSWER_S)
    assert r.status_code == 200, r.text
    after = metrics()
    print(f"{names}: answered in {time.monotonic() - t0:.1f} s")
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
