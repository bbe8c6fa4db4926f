"""Background threads whose torch ops run on the thread itself, never on an OpenMP team.

With an OpenMP build of torch (the Linux and macOS wheels), the first parallel op a thread
issues gives that thread its own team of ``torch.get_num_threads()`` workers, which lives
as long as the thread. Once the OpenMP runtime manages more threads than the machine has
CPUs, libgomp stops spinning between parallel regions (its "throttled" spin count): the
forward's own team then sleeps and is woken at every op. On a 2-core CPU server one idle
promotion thread that had run a single rotation made every later forward slower, decode
included (``bench/RESULTS.md``, "Design studies"). The work of our threads
(write-back, promotion, layer loads, shared-store calls) is off the request's critical
path; the forward should keep every core. So each of them confines itself first.

Confinement sets the calling thread's own OpenMP ``nthreads`` (a per-thread setting), so
the forward's thread, and every thread not started here, keep theirs. ``torch.set_num_threads``
cannot be used: it also changes the process-wide default that threads started later pick up.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

# File-name prefixes of the GNU, Intel and LLVM OpenMP runtimes.
OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def openmp_runtimes() -> tuple[ctypes.CDLL, ...]:
    """Every OpenMP runtime loaded into this process when first asked: torch's, and any
    other a wheel bundles (sentencepiece ships its own libgomp, loaded beside torch's in
    a server). Empty without OpenMP, or without ``/proc/self/maps`` to find them in."""
    try:
        with open("/proc/self/maps") as maps:
            paths = dict.fromkeys(line.split()[-1] for line in maps if "/" in line)
    except OSError:
        return ()
    found = []
    for path in paths:
        if not path.rsplit("/", 1)[-1].startswith(OPENMP_LIBRARIES):
            continue
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads  # noqa: B018 - raises AttributeError if absent
        except (OSError, AttributeError):
            continue
        found.append(lib)
    return tuple(found)


_warned = threading.Event()


def confine_torch_threads() -> bool:
    """Makes torch ops issued later by the calling thread run on it alone. Changes only
    this thread's OpenMP setting. True when the thread's ops are single-threaded now;
    False (logged once per process) when this torch build leaves no per-thread control."""
    # Reading the count first runs torch's per-thread lazy initialisation, which would
    # otherwise reset the setting at this thread's first parallel op.
    if torch.get_num_threads() == 1:
        return True
    # Every runtime, not only torch's: which one torch uses is not exposed, and a
    # bundled one's parallel regions issued from this thread would oversubscribe too.
    for lib in openmp_runtimes():
        lib.omp_set_num_threads(1)
    if torch.get_num_threads() == 1:
        return True
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "sgl_pic: this torch build gives background threads no per-thread thread count; "
            "their ops may take cores from the forward"
        )
    return False


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A started daemon thread running ``target()`` after ``confine_torch_threads``."""

    def run() -> None:
        confine_torch_threads()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def thread_pool(workers: int, name_prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose threads confine themselves as they start."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name_prefix, initializer=confine_torch_threads
    )
