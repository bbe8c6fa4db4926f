"""Background threads run torch ops on themselves: no OpenMP team of their own that would
make the forward's team stop spinning (``sgl_pic.worker_threads``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from sgl_pic.worker_threads import confine_torch_threads, start_thread, thread_pool

# In a fresh process: the OS threads alive while a background thread that has just run
# parallel-sized ops (elementwise, matmul, attention) waits, with or without confinement.
PROBE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    try:
        import sentencepiece  # bundles a second libgomp, as in a server process
    except ImportError:
        pass
    import torch
    from sgl_pic.worker_threads import confine_torch_threads, openmp_runtimes

    def tasks():
        return len(os.listdir("/proc/self/task"))

    torch.ones(4_000_000).mul(2)  # the main thread's own team exists before we count
    time.sleep(0.2)
    base = tasks()
    seen = {}
    held = threading.Event()
    release = threading.Event()

    def work():
        if sys.argv[1] == "confined":
            seen["confined"] = confine_torch_threads()
        seen["threads_in_worker"] = torch.get_num_threads()
        torch.randn(4_000_000).mul(2).sum()
        a = torch.randn(1024, 1024)
        (a @ a).sum()
        q = torch.randn(1, 3, 1024, 64)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        held.set()
        release.wait()

    t = threading.Thread(target=work)
    t.start()
    held.wait()
    during = tasks()
    release.set()
    t.join()
    runtimes = len(openmp_runtimes())
    print(json.dumps(dict(seen, base=base, during=during, main=torch.get_num_threads(),
                          runtimes=runtimes)))
    """
)


def probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_a_confined_thread_adds_no_openmp_team_and_leaves_the_main_count() -> None:
    plain = probe("plain")
    if plain["main"] < 2 or plain["during"] == plain["base"] + 1:
        pytest.skip("this torch gives a background thread no team of its own to remove")
    # The failure being prevented: the background thread brought up its own team.
    assert plain["during"] > plain["base"] + 1
    confined = probe("confined")
    assert confined["confined"] is True
    assert confined["threads_in_worker"] == 1
    assert confined["during"] == confined["base"] + 1  # the worker itself, nothing more
    assert confined["main"] == plain["main"]  # the forward's thread keeps its count


def in_thread(fn) -> object:  # noqa: ANN001
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_confinement_is_per_thread() -> None:
    before = torch.get_num_threads()
    assert in_thread(lambda: (confine_torch_threads(), torch.get_num_threads())) == (True, 1)
    assert torch.get_num_threads() == before
    # A thread started later, unconfined, still gets the process's count.
    assert in_thread(torch.get_num_threads) == before


def test_start_thread_and_thread_pool_confine_their_threads() -> None:
    seen: list[int] = []
    start_thread(lambda: seen.append(torch.get_num_threads()), "sgl-pic-test").join()
    with thread_pool(2, "sgl-pic-test") as pool:
        seen += [f.result() for f in [pool.submit(torch.get_num_threads) for _ in range(4)]]
    assert seen == [1] * 5
