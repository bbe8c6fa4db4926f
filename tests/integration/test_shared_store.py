"""Two servers on one shared chunk store (Mooncake, started here): a chunked request on B
hits chunks only A computed, with A's output; killing and restarting the store never
stops either server; a corrupt object in the store is detected and recomputed.

The servers run at the same time (the point of the test), so each step waits on the
metrics rather than on time.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from sgl_pic.store.format import read_header
from sgl_pic.store.object_backend import make_backend
from sgl_pic.store.shared.service import SharedStoreService
from tests.store.shared_helpers import start_service
from tests.support.prompts import body, chunked, ids
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

STORED = 'sgl_pic_shared_writes_total{outcome="stored"}'
SHARED_HITS = 'sgl_pic_tier_hits_total{tier="shared"}'
MISSES = "sgl_pic_chunk_misses_total"
UNREACHABLE = "sgl_pic_shared_store_unreachable_total"
CORRUPT = 'sgl_pic_store_errors_total{kind="shared_corrupt"}'
UP = "sgl_pic_shared_store_up"


@pytest.fixture(scope="module")
def service() -> Iterator[SharedStoreService]:
    svc = start_service(memory_mb=256)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def servers(service: SharedStoreService) -> Iterator[tuple[Server, Server]]:
    args = ("--pic-shared-store", service.url, "--pic-policy", "cachetune")
    with ExitStack() as stack, cf.ThreadPoolExecutor(2) as pool:
        # Started together: two start-ups one after the other would double the wait.
        futures = [pool.submit(stack.enter_context, launch(*args)) for _ in range(2)]
        a, b = (f.result() for f in futures)
        yield a, b


# Passages no other step uses: a step's chunks are new to both servers, so the one that
# gets the request first computes them and writes them to the store.
FRESH = {
    "G": "Reykjavik is the northernmost capital of a sovereign state and heats its homes with "
    "water from hot springs.",
    "H": "Timbuktu, at the edge of the Sahara, kept thousands of old manuscripts in family "
    "libraries.",
    "I": "La Paz lies more than three and a half kilometres above sea level in the Andes.",
    "J": "Hobart, on the island of Tasmania, is the second oldest capital city in Australia.",
}


def fresh(names: list[str], question: str, tag: str = "") -> tuple[list[int], list[list[int]]]:
    """Token ids and chunk spans of FRESH passages (each prefixed with ``tag``: new chunks),
    then the question."""
    toks: list[int] = []
    spans = []
    for name in names:
        t = ids(tag + FRESH[name] + "\n")
        spans.append([len(toks), len(toks) + len(t)])
        toks += t
    return toks + ids("Question: " + question + "\nAnswer:"), spans


def metric(server: Server, name: str) -> float:
    return server.metrics().get(name, 0.0)


def poll(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    if not poll(check, timeout_s):
        pytest.fail(f"timed out waiting for {what}")


def generate(server: Server, req: dict) -> list[int]:
    r = server.generate(req)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_b_hits_chunks_only_a_computed(servers: tuple[Server, Server]) -> None:
    a, b = servers
    toks, spans = chunked(["A", "B", "C"], "Which of these cities lies on the equator?")
    req = body(toks, spans)
    stored0 = metric(a, STORED)
    out_a = generate(a, req)
    wait_for(lambda: metric(a, STORED) >= stored0 + 3, "A's chunks in the shared store")
    hits0, misses0 = metric(b, SHARED_HITS), metric(b, MISSES)
    out_b = generate(b, req)
    assert metric(b, SHARED_HITS) - hits0 == 3, b.log_tail()
    assert metric(b, MISSES) == misses0
    assert out_b == out_a


def test_store_killed_and_restarted_mid_run(
    servers: tuple[Server, Server], service: SharedStoreService
) -> None:
    a, b = servers
    service.kill()
    toks, spans = chunked(["D", "E"], "Which city is the oldest?", header="Notes:\n")
    for server in (a, b):
        generate(server, body(toks, spans))
    wait_for(
        lambda: metric(a, UNREACHABLE) >= 1 and metric(b, UNREACHABLE) >= 1,
        "both servers to count the outage",
    )
    service.start()
    # Each server finds the store again by its own background probe; until then each
    # attempt (new chunks every time) is served from its own tiers, and A does not write
    # it, or B does not look there. An attempt ends once A has written its chunks and B
    # has read them both from the store.
    for attempt in range(15):
        toks, spans = fresh(["G", "H"], "Which city uses hot springs?", f"({attempt}) ")
        req = body(toks, spans)
        stored0 = metric(a, STORED)
        generate(a, req)
        if not poll(lambda s0=stored0: metric(a, STORED) >= s0 + 2, 5.0):
            continue
        hits0 = metric(b, SHARED_HITS)
        generate(b, req)
        if metric(b, SHARED_HITS) - hits0 == 2:
            break
    else:
        pytest.fail(f"B never read A's chunks from the restarted store\n{b.log_tail()}")
    assert metric(a, UP) == 1.0 and metric(b, UP) == 1.0


def test_corrupt_object_is_detected_and_recomputed(
    servers: tuple[Server, Server], service: SharedStoreService, tmp_path: Path
) -> None:
    a, b = servers
    toks, spans = fresh(["I", "J"], "Which city is high in the mountains?")
    req = body(toks, spans)
    before = set(service.keys())
    out_a = generate(a, req)
    wait_for(lambda: len(set(service.keys()) - before) >= 2, "A's new chunks in the store")
    backend = make_backend(service.url)
    backend.connect()
    try:
        for key in sorted(set(service.keys()) - before):
            size = backend.size(key)
            assert size is not None
            data = bytearray(backend.read_ranges(key, [(0, size)]).tobytes())  # type: ignore[union-attr]
            tmp = tmp_path / key
            tmp.write_bytes(data)
            h = read_header(tmp)
            # One byte of every checksum block of layer 0's K: whichever tokens B loads,
            # its first layer read fails verification. The header stays valid.
            for first in range(0, h.num_tokens, h.block_tokens):
                data[h.data_offset + first * h.row_bytes] ^= 0xFF
            backend.remove(key)
            backend.put_if_absent(key, [bytes(data)])
    finally:
        backend.close()
    misses0, corrupt0 = metric(b, MISSES), metric(b, CORRUPT)
    out_b = generate(b, req)
    assert metric(b, CORRUPT) - corrupt0 >= 1, b.log_tail()
    # Recomputed: on B it was a miss (in the lookup, or in the retry after the load).
    assert metric(b, MISSES) > misses0
    assert out_b == out_a
