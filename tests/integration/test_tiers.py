"""Host and disk tiers through the server: chunks persist across a restart and are
served from disk alone, host hits are loaded sparsely, damaged chunk files are detected
and recomputed, and a disk that refuses every write changes nothing but the counters.

Four launches, each run to completion and stopped inside its fixture (so no two servers
ever share the two cores): ``first`` computes chunks into a disk directory; ``restarted``
serves from that directory alone after some files were damaged; ``host_only`` and
``size_limited`` run one sequence of long chunks, the second under a file-size limit that
no chunk file fits. Every output is greedy with ``ignore_eos``, so each compared output
is ``N_OUT`` tokens long.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.store.format import PREFIX_BYTES, SUFFIX, TMP_PREFIX, read_header, read_record
from tests.support.prompts import DOCS, ids
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

N_OUT = 12
DISK_ONLY = ("--pic-device-cache-fraction", "0", "--pic-host-cache-mb", "0")
HOST_ONLY = ("--pic-policy", "cachetune", "--pic-device-cache-fraction", "0")
# Large enough for what SGLang itself writes under the limit (its log, prometheus's
# 1 MiB multiprocess files: with 4 KiB the server dies at start-up), smaller than any
# chunk file of LONG (each > 2 MiB: 30 layers x 2 x 48+ tokens x 768 bytes).
FILE_SIZE_LIMIT = 1 << 20

TEXTS = {
    **DOCS,
    "F": "Hobart, on the island of Tasmania, is the second oldest capital city in Australia.",
    "L1": "The Danube rises in the Black Forest of Germany and flows east for about 2,850 "
    "kilometres through ten countries, passing Vienna, Bratislava, Budapest and Belgrade "
    "before it reaches a wide delta on the Black Sea coast of Romania.",
    "L2": "Mount Kilimanjaro in Tanzania is the highest mountain in Africa; its three volcanic "
    "cones rise almost six kilometres above sea level, and climbers pass through rainforest, "
    "heath, alpine desert and finally glaciers on the way to the summit.",
    "L3": "Chile's Atacama Desert, in the north, is one of the driest places on Earth: some of "
    "its weather stations have never recorded rain, and astronomers build large telescopes "
    "there because the air above it is thin, dry and very clear.",
}
LONG = ["L1", "L2", "L3"]

# (chunks, question, per-request overrides). The write-up starts with a fresh header and
# every other prompt with a chunk no earlier prompt starts with, so SGLang's own prefix
# cache never serves part of a prompt and every chunk goes through the chunk tiers.
WRITE = (["A", "B", "C", "D", "E", "F"], "Which of these cities lies on the equator?")
RESTART = (["C", "B", "A"], "Which city had wooden temples?", {})
RECOMPUTE = (["E", "F"], "Which city is in Australia?", {})
AGAIN = (["F", "E"], "Which port has funiculars?", {})
PAYLOAD = (["D"], "When does Tromso see the midnight sun?", {"policy": "cachetune"})
AFTER_PAYLOAD = (["A", "D"], "Which city is a UNESCO site?", {"policy": "cachetune"})
REFERENCE = {"restart": RESTART, "recompute": RECOMPUTE, "again": AGAIN}
REFERENCE |= {"payload": PAYLOAD, "after_payload": AFTER_PAYLOAD}
LONG_WRITE = (LONG, "Which river reaches the Black Sea?")
LONG_REUSE = (LONG[::-1], "Where do astronomers build telescopes?")

FAILURES = "sgl_pic_failures_total"
MISSES = "sgl_pic_chunk_misses_total"
RETRIES = "sgl_pic_retries_total"
LOADED = "sgl_pic_bytes_loaded_total"
DENSE = "sgl_pic_bytes_dense_total"
RECOMPUTED = "sgl_pic_recomputed_tokens_total"
REUSED = "sgl_pic_reused_tokens_total"


def tier(name: str) -> str:
    return f'sgl_pic_tier_hits_total{{tier="{name}"}}'


def store_error(kind: str) -> str:
    return f'sgl_pic_store_errors_total{{kind="{kind}"}}'


# ----------------------------------------------------------------------------- helpers
def chunk_ids(name: str) -> tuple[int, ...]:
    return tuple(ids(TEXTS[name] + "\n"))


@dataclass(frozen=True)
class Prompt:
    toks: list[int]
    spans: list[list[int]]
    fresh: int  # tokens outside every chunk (header, question)

    @property
    def chunk_lengths(self) -> list[int]:
        return [e - s for s, e in self.spans]


def prompt(names: list[str], question: str, header: str = "") -> Prompt:
    toks = ids(header) if header else []
    spans = []
    for name in names:
        t = list(chunk_ids(name))
        spans.append([len(toks), len(toks) + len(t)])
        toks += t
    toks += ids("Question: " + question + "\nAnswer:")
    return Prompt(toks, spans, len(toks) - sum(e - s for s, e in spans))


@dataclass(frozen=True)
class Run:
    """One request: its greedy output, SGLang's prefix-cache tokens, and how much each
    sgl_pic series moved during it (``after``: the series right after)."""

    output_ids: list[int]
    cached_tokens: int
    delta: dict[str, float]
    after: dict[str, float]

    def d(self, series: str) -> float:
        return self.delta.get(series, 0.0)


def run(server: Server, p: Prompt, repeat: bool = False, **pic: object) -> Run:
    """Runs ``p``; unless ``repeat``, no part of it may come from SGLang's own prefix
    cache, so that every chunk goes through the chunk tiers."""
    req: dict = {
        "input_ids": p.toks,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_OUT, "ignore_eos": True},
        "pic": {"chunks": p.spans, **({"config": pic} if pic else {})},
    }
    before = server.metrics()
    r = server.generate(req)
    assert r.status_code == 200, r.text
    after = server.metrics()
    out = r.json()
    assert len(out["output_ids"]) == N_OUT
    assert repeat or out["meta_info"]["cached_tokens"] == 0
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}
    return Run(out["output_ids"], out["meta_info"]["cached_tokens"], delta, after)


def segment_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + SUFFIX))


def all_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, temp files (dot names) included."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.5)


def file_of(root: Path, name: str) -> Path:
    """The segment file holding chunk ``name`` (every chunk here is one segment)."""
    want = chunk_ids(name)
    found = [p for p in segment_files(root) if read_header(p).token_ids == want]
    assert len(found) == 1, (name, found)
    return found[0]


def verifies(path: Path) -> bool:
    """Whether ``path`` is a whole chunk file whose every payload block checks out."""
    try:
        read_record(path)
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Server 1 (default tiers, disk directory D) computes chunks A-F, then runs every
    prompt the restarted server will get, hitting its device tier: the clean outputs."""
    root = tmp_path_factory.mktemp("disk")
    with launch("--pic-disk-cache-dir", str(root)) as s:
        write = run(s, prompt(WRITE[0], WRITE[1], header="Notes on six cities.\n"))
        n = len(WRITE[0])
        # The host tier's writer puts new chunks on disk in the background.
        wait_for(lambda: len(segment_files(root)) == n, f"{n} chunk files in {root}")
        wait_for(
            lambda: not [p for p in all_files(root) if p.name.startswith(TMP_PREFIX)],
            "no temp files",
        )
        refs = {key: run(s, prompt(names, q), **pic) for key, (names, q, pic) in REFERENCE.items()}
    return {"root": root, "write": write, "refs": refs}


@pytest.fixture(scope="module")
def restarted(first: dict) -> dict:
    """With no server running, three of server 1's chunk files are damaged: E's is
    truncated, a byte of F's header is flipped, bytes of D's payload (layer 0 keys) are
    flipped; A-C stay intact. Server 2 then serves from that directory alone (no device
    nodes, no host memory), and runs the reference prompts in order."""
    root: Path = first["root"]
    paths = {name: file_of(root, name) for name in "ABCDEF"}
    e = paths["E"]
    os.truncate(e, e.stat().st_size - 1000)
    with open(paths["F"], "r+b") as f:
        f.seek(PREFIX_BYTES + 8)
        byte = f.read(1)
        f.seek(PREFIX_BYTES + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    d_offset = read_header(paths["D"]).data_offset
    with open(paths["D"], "r+b") as f:
        f.seek(d_offset + 100)
        chunk = f.read(16)
        f.seek(d_offset + 100)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert not any(verifies(paths[n]) for n in "DEF")

    runs: dict[str, Run] = {}
    valid: dict[str, dict[str, bool]] = {}
    present: dict[str, dict[str, bool]] = {}
    with launch("--pic-disk-cache-dir", str(root), *DISK_ONLY) as s:
        at_start = {name: p.exists() for name, p in paths.items()}
        for key, (names, q, pic) in REFERENCE.items():
            runs[key] = run(s, prompt(names, q), **pic)
            present[key] = {name: p.exists() for name, p in paths.items()}
            valid[key] = {name: verifies(p) for name, p in paths.items()}
    return {"at_start": at_start, "runs": runs, "present": present, "valid": valid}


def _long_sequence(s: Server, root: Path) -> dict[str, Run]:
    write = run(s, prompt(*LONG_WRITE))
    # Let the background writer try every chunk before the next request reports errors.
    wait_for(
        lambda: not [p for p in all_files(root) if p.name.startswith(TMP_PREFIX)],
        "no temp files",
    )
    time.sleep(2.0)
    return {"write": write, "reuse": run(s, prompt(*LONG_REUSE))}


@pytest.fixture(scope="module")
def host_only(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Server 3: cachetune, no device nodes, host memory on (disk written behind it)."""
    root = tmp_path_factory.mktemp("host_only")
    with launch("--pic-disk-cache-dir", str(root), *HOST_ONLY) as s:
        runs = _long_sequence(s, root)
        wait_for(lambda: len(segment_files(root)) == len(LONG), f"{len(LONG)} chunk files")
    return {"root": root, "runs": runs}


def _limit_file_size() -> None:
    # Inherited by SGLang's processes; Python ignores SIGXFSZ, so an oversized write
    # fails with EFBIG instead of killing the writer.
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


@pytest.fixture(scope="module")
def size_limited(tmp_path_factory: pytest.TempPathFactory, host_only: dict) -> dict:
    """Server 4: server 3's settings and requests, every chunk file write refused."""
    root = tmp_path_factory.mktemp("size_limited")
    with launch("--pic-disk-cache-dir", str(root), *HOST_ONLY, preexec=_limit_file_size) as s:
        runs = _long_sequence(s, root)
        # Write errors reach /metrics with the next chunked batch; repeat the last
        # request (its prefix is cached now) until they are in.
        last = runs["reuse"]
        for _ in range(10):
            if last.after.get(store_error("enospc"), 0.0) >= len(LONG):
                break
            time.sleep(1.0)
            last = run(s, prompt(*LONG_REUSE), repeat=True)
        files = all_files(root)
    return {"root": root, "runs": runs, "last": last, "files": files}


# ----------------------------------------------------------------------------- tests
def test_restart_serves_chunks_from_disk_alone(first: dict, restarted: dict) -> None:
    ref: Run = first["refs"]["restart"]
    # Server 1 served the same prompt from its device nodes.
    assert ref.cached_tokens == 0 and ref.d(tier("device")) == 3 and ref.d(MISSES) == 0
    got: Run = restarted["runs"]["restart"]
    assert got.cached_tokens == 0
    assert got.d(MISSES) == 0
    assert got.d(tier("disk")) == 3
    assert got.d(tier("device")) == got.d(tier("host")) == 0
    assert got.d(LOADED) > 0
    assert got.d(FAILURES) == 0
    # Keys went device -> pre-RoPE file -> rotated to the new positions: the same greedy
    # tokens as server 1 produced from its device copies.
    assert got.output_ids == ref.output_ids


def test_damaged_files_found_at_startup_are_dropped_recomputed_and_rewritten(
    first: dict, restarted: dict
) -> None:
    at_start, runs, valid = restarted["at_start"], restarted["runs"], restarted["valid"]
    # A truncated file and a corrupt header fail the index rebuild: deleted at start-up.
    assert not at_start["E"] and not at_start["F"]
    assert at_start["A"] and at_start["B"] and at_start["C"] and at_start["D"]
    got: Run = runs["recompute"]
    assert got.after.get(store_error("truncated"), 0.0) == 1
    assert got.after.get(store_error("corrupt"), 0.0) >= 1
    assert got.d(MISSES) == 2
    assert got.d(tier("disk")) == 0
    assert got.d(FAILURES) == 0
    assert got.output_ids == first["refs"]["recompute"].output_ids
    # Recomputed chunks were written back whole, and the next prompt reuses them.
    assert valid["recompute"]["E"] and valid["recompute"]["F"]
    again: Run = runs["again"]
    assert again.d(tier("disk")) == 2
    assert again.d(MISSES) == 0
    assert again.d(FAILURES) == 0
    assert again.output_ids == first["refs"]["again"].output_ids


def test_corrupt_payload_is_detected_dropped_and_recovered(first: dict, restarted: dict) -> None:
    runs, valid = restarted["runs"], restarted["valid"]
    before = runs["again"].after.get(store_error("corrupt"), 0.0)
    # The checksum failure is counted (by the first batch that reports after it) ...
    assert runs["after_payload"].after.get(store_error("corrupt"), 0.0) == before + 1
    # ... and the bad bytes are never on disk again: deleted, or replaced by a whole file.
    assert not restarted["present"]["payload"]["D"] or valid["payload"]["D"]
    # The next prompt using D is served with reuse of A and the clean output.
    after: Run = runs["after_payload"]
    assert after.d(FAILURES) == 0
    assert after.d(tier("disk")) + after.d(MISSES) == 2
    assert after.output_ids == first["refs"]["after_payload"].output_ids
    assert valid["after_payload"]["D"]


def test_corrupt_payload_chunk_is_recomputed_without_failure(first: dict, restarted: dict) -> None:
    # Found while phase 2 loads it: the batch runs again, with D as a miss.
    got: Run = restarted["runs"]["payload"]
    assert got.d(FAILURES) == 0
    assert got.d(RETRIES) == 1
    assert got.d(MISSES) == 1
    assert got.output_ids == first["refs"]["payload"].output_ids
    assert restarted["valid"]["payload"]["D"]


def test_host_hits_load_only_tokens_not_recomputed(host_only: dict) -> None:
    p = prompt(*LONG_REUSE)
    got: Run = host_only["runs"]["reuse"]
    assert got.cached_tokens == 0
    assert got.d(tier("host")) == len(LONG)
    assert got.d(MISSES) == 0
    assert got.d(FAILURES) == 0
    loaded, dense = got.d(LOADED), got.d(DENSE)
    assert 0 < loaded < dense
    # Fresh tokens (the question) are always recomputed; the rest of the recomputed
    # tokens lie in the chunks, and exactly those rows are not loaded.
    chunk_tokens = sum(p.chunk_lengths)
    recomputed_in_chunks = got.d(RECOMPUTED) - p.fresh
    assert 0 < recomputed_in_chunks < chunk_tokens
    assert got.d(REUSED) == chunk_tokens - recomputed_in_chunks
    assert loaded / dense == pytest.approx(1 - recomputed_in_chunks / chunk_tokens, rel=1e-9)
    # CacheTune recomputes ceil(r * n) tokens of each n-token chunk: the recomputed share
    # lies in [r, r + chunks / chunk_tokens), so bytes loaded / dense lies just under 1 - r.
    r = PicConfig().cachetune_r
    share = recomputed_in_chunks / chunk_tokens
    assert r <= share < r + len(p.spans) / chunk_tokens


def test_refused_disk_writes_change_only_the_counters(host_only: dict, size_limited: dict) -> None:
    # Without the limit the same requests left one file per chunk, each over the limit.
    sizes = [p.stat().st_size for p in segment_files(host_only["root"])]
    assert len(sizes) == len(LONG) and min(sizes) > FILE_SIZE_LIMIT
    runs, ref = size_limited["runs"], host_only["runs"]
    assert size_limited["last"].after.get(store_error("enospc"), 0.0) == len(LONG)
    assert size_limited["last"].after.get(FAILURES, 0.0) == 0
    assert runs["write"].d(MISSES) == len(LONG)
    assert runs["reuse"].d(tier("host")) == len(LONG)
    assert runs["write"].output_ids == ref["write"].output_ids
    assert runs["reuse"].output_ids == ref["reuse"].output_ids
    # No chunk file, no temp file, no partial file.
    assert size_limited["files"] == []
