"""What an idle background thread that once ran a parallel torch op costs the forward.

    python bench/openmp_teams.py [--out bench/results/openmp_teams.json]

A thread's first parallel torch op gives it an OpenMP team of its own, alive as long as
the thread. With more libgomp threads than CPUs, libgomp throttles its spin-wait and the
main thread's team sleeps and is woken at every op. This times a main-thread loop of
decode-sized ops (a 4-token projection, its activation, a gather of KV rows) alone, beside
an idle thread that ran one large op unconfined, and beside one that first called
``sgl_pic.worker_threads.confine_torch_threads``; the three are interleaved over rounds so
that machine noise spreads over all of them, with the process's context switches counted
per loop. Ratios are the median over rounds of each loop's seconds over that round's loop
alone.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_out_option, git_state, write_json  # noqa: E402

# torch is imported where it is used, after the arguments are parsed: --help answers at once.
CONDITIONS = ("alone", "beside_unconfined", "beside_confined")


class LoopTime(NamedTuple):
    seconds: float
    context_switches: int


class IdleThread(NamedTuple):
    thread: threading.Thread
    release: threading.Event  # set: the thread returns


def context_switches() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def decode_loop(steps: int) -> LoopTime:
    """The seconds and context switches of ``steps`` rounds of decode-sized ops."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 576, generator=g)  # [tokens, hidden]
    w = torch.randn(576, 1536, generator=g)  # [hidden, intermediate]
    kv = torch.randn(4000, 192, generator=g)  # [slots, kv_heads * head_dim]
    rows = torch.arange(0, 4000, 2)
    c0, t0 = context_switches(), time.perf_counter()
    for _ in range(steps):
        torch.nn.functional.silu(x @ w)
        kv.index_select(0, rows).mul_(1.0001)
    return LoopTime(time.perf_counter() - t0, context_switches() - c0)


def idle_thread(confined: bool) -> IdleThread:
    """A started thread that ran one parallel-sized op and now waits for its event."""
    import torch

    from sgl_pic.worker_threads import confine_torch_threads

    release, ready = threading.Event(), threading.Event()

    def run() -> None:
        if confined:
            confine_torch_threads()
        torch.randn(4_000_000).mul(2).sum()
        ready.set()
        release.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait()
    return IdleThread(thread, release)


def measure(condition: str, steps: int) -> LoopTime:
    if condition == "alone":
        return decode_loop(steps)
    thread, release = idle_thread(confined=condition == "beside_confined")
    try:
        return decode_loop(steps)
    finally:
        release.set()
        thread.join()
        time.sleep(0.2)  # the team's workers end after their thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3000)
    add_out_option(ap, "openmp_teams.json")
    args = ap.parse_args()
    import torch

    commit, dirty = git_state()
    decode_loop(300)  # the main thread's own team exists before anything is timed
    rounds = []
    for _ in range(args.rounds):
        row = {}
        for c in CONDITIONS:
            row[c] = measure(c, args.steps)._asdict()
        rounds.append(row)
    ratios = {
        c: statistics.median(r[c]["seconds"] / r["alone"]["seconds"] for r in rounds)
        for c in CONDITIONS[1:]
    }
    switches = {c: statistics.median(r[c]["context_switches"] for r in rounds) for c in CONDITIONS}
    report = {
        "git_commit": commit,
        "git_dirty": dirty,
        "args": vars(args),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "ratio_to_alone_median": ratios,
        "context_switches_median": switches,
        "rounds": rounds,
    }
    for c in CONDITIONS[1:]:
        print(f"{c}: {ratios[c]:.2f}x the loop alone")
    print(f"context switches per loop (median): {switches}")
    write_json(args.out, report, newline=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
