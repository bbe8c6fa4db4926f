"""A decoding request's inter-token gaps while a cold chunked prompt is prefilled.

    python bench/itl.py                          # the record (--repetitions 5)
    python bench/itl.py --quick                  # sanity run: one repetition
    python bench/itl.py --ref-root /tmp/base     # also a server run from another checkout

One default server (``python -m sgl_pic.launch_server`` on the embedded model, SGLang's
default arguments, a temporary disk tier of its own) serves every trial. In a trial one
request decodes (streamed, ``ignore_eos``, the arrival time of each token kept); once it
has streamed ``--lead`` tokens a cold prompt of about ``--prompt-tokens`` tokens arrives
with ``max_new_tokens=1``: MuSiQue passages never sent before in the run, each a chunk,
behind the system chunk and before a question. It arrives either chunked (``pic`` marks:
every passage a miss) or as the same tokens unchunked (no marks: SGLang's own chunked
prefill, ``plain``). Each repetition runs both, over the same passages (each behind a
fresh header, so SGLang's prefix tree misses), in alternating order.

Per trial: the decoding request's longest gap between two consecutive tokens whose
interval overlaps the prompt's time in the server (``gap_s``; all of those gaps in
``gaps_during_s``), its median gap before the prompt arrived (``itl_s``), and
``stretch_s`` = gap - itl: what the prompt added to the longest wait. Per repetition,
chunked over plain of both (``gap_ratio``, ``stretch_ratio``); the summary gives their
medians. Chunked trials also record the executor's per-batch seconds (its log line:
assemble + phase 1, select + phase 2), the extend batches SGLang formed, and their
/metrics: split requests, misses, chunks deferred by store admission and encoded,
recomputed tokens, the selection's seconds (the query probe included), fallbacks and
failures (``check``: the chunked prompt was taken on the chunk path and split, with no
fallback or failure).

``--ref-root``: a second server, the same flags, its code from another checkout (the
commit before a change, ``git worktree add``); both are up and the one not measured is
paused (SIGSTOP), each repetition measures both, so ``compare`` pairs this tree's chunked
gap with the other's over the same prompts. ``servers.*.chunked_prefill_size`` is what
each server resolved (``/server_info``). Results: ``bench/results/itl.json``. Timings mean
something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, when loaded by path
from _common import (  # noqa: E402
    ROOT,
    add_data_option,
    add_out_option,
    embedded_tokenizer,
    git_state,
    write_json,
)
from _server import Client, delta, fresh_header, launch, metric  # noqa: E402

METRICS = {
    "split_requests": "sgl_pic_split_requests_total",
    "misses": "sgl_pic_chunk_misses_total",
    "deferred": "sgl_pic_chunk_deferred_total",
    "encoded_tokens": "sgl_pic_encoded_tokens_total",
    "recomputed_tokens": "sgl_pic_recomputed_tokens_total",
    "fallbacks": "sgl_pic_fallbacks_total",
    "failures": "sgl_pic_failures_total",
    # The policy's selection, the query probe's pass included.
    "selection_s": "sgl_pic_selection_seconds_sum",
}
DECODE_PROMPT = "Write a very long story about a lighthouse keeper and the sea, chapter by chapter."


class Passages:
    """MuSiQue passages in order, each handed out once (a cold chunk every time)."""

    def __init__(self, data: Path, passage_tokens: int) -> None:
        from sgl_pic.prompts import load_rag_examples

        seen: set[str] = set()
        self.texts: list[str] = []
        self.questions: list[str] = []
        for ex in load_rag_examples(data):
            self.questions.append(ex.question)
            for p in ex.passages:
                if p not in seen:
                    seen.add(p)
                    self.texts.append(p)
        self.passage_tokens = passage_tokens
        self.next = 0

    def prompt(self, tokenizer: Any, tokens: int) -> tuple[list[int], list[list[int]]]:
        """Token ids and chunk spans of a prompt of at most ``tokens`` tokens, as many
        unused passages as fit."""
        from sgl_pic.prompts import build_prompt, truncate_tokens

        question = self.questions[self.next % len(self.questions)]
        taken: list[str] = []
        best = None
        while self.next < len(self.texts):
            text = truncate_tokens(tokenizer, self.texts[self.next], self.passage_tokens)
            trial = build_prompt(tokenizer, [*taken, text], question)
            if trial.layout.num_tokens > tokens:
                break
            taken.append(text)
            self.next += 1
            best = trial
        if best is None:
            raise SystemExit("no unused passage fits --prompt-tokens")
        spans = [[s.start, s.end] for s in best.layout.chunks]
        return best.token_ids.tolist(), spans


class Decoder(threading.Thread):
    """A streamed decoding request, the arrival time of each of its tokens kept, until
    ``stop`` (the stream is closed; SGLang aborts the request)."""

    def __init__(self, url: str, tokenizer: Any) -> None:
        super().__init__(daemon=True)
        ids = tokenizer(DECODE_PROMPT, add_special_tokens=False)["input_ids"]
        self.body = {
            "input_ids": fresh_header(tokenizer) + list(ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": 6000, "ignore_eos": True},
            "stream": True,
        }
        self.url = url
        self.times: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with requests.post(
                self.url + "/generate", json=self.body, stream=True, timeout=900
            ) as r:
                r.raise_for_status()
                count = 0
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if self.stop.is_set():
                        break
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    done = int(json.loads(line[5:])["meta_info"]["completion_tokens"])
                    # One arrival per token, however many a chunk of the stream carried.
                    self.times += [now] * (done - count)
                    count = done
        except BaseException as e:  # the main thread reports it
            self.error = e

    def wait_for(self, n: int, timeout_s: float = 600.0) -> None:
        end = time.monotonic() + timeout_s
        while len(self.times) < n:
            if self.error is not None or not self.is_alive():
                raise RuntimeError(f"the decoding request ended early: {self.error!r}")
            if time.monotonic() > end:
                raise RuntimeError(f"the decoding request streamed {len(self.times)} of {n}")
            time.sleep(0.005)


def gaps(times: list[float], start: float, end: float) -> tuple[list[float], float]:
    """(the gaps between consecutive arrivals overlapping [start, end], in order; the
    median gap of the arrivals before ``start``)."""
    pairs = list(zip(times, times[1:], strict=False))
    during = [b - a for a, b in pairs if b > start and a < end]
    before = [b - a for a, b in pairs if b <= start]
    return during, statistics.median(before)


def trial(
    client: Client, tok: Any, ids: list[int], spans: list[list[int]] | None, lead: int, tail: int
) -> dict[str, Any]:
    """One decoding request and one cold prompt (chunked when ``spans``) arriving during it."""
    head = fresh_header(tok)
    body: dict[str, Any] = {
        "input_ids": head + ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
    }
    if spans is not None:
        body["pic"] = {"chunks": [[a + len(head), b + len(head)] for a, b in spans]}
    decoder = Decoder(client.url, tok)
    decoder.start()
    try:
        decoder.wait_for(lead)
        client.skip_log()
        before = client.metrics()
        t0 = time.perf_counter()
        client.generate(body)
        t1 = time.perf_counter()
        arrived = len(decoder.times)
        decoder.wait_for(arrived + tail)
    finally:
        decoder.stop.set()
    decoder.join(timeout=120)
    during, itl = gaps(decoder.times, t0, t1)
    gap = max(during)
    d = delta(before, client.metrics())
    batches, tokens = client.prefill_batches()
    return {
        "chunked": spans is not None,
        "prompt_tokens": len(body["input_ids"]),
        "chunks": len(spans) if spans is not None else 0,
        "prompt_s": t1 - t0,
        "gap_s": gap,
        "itl_s": itl,
        "stretch_s": gap - itl,
        # Every gap while the prompt was in the server: tokens decoded between its pieces
        # show as several long gaps, one per prefill batch.
        "gaps_during_s": during,
        "extend_batches": batches,
        "extend_tokens": tokens,
        "phase_seconds": client.phase_timings(),
        "metrics": {k: metric(d, name) for k, name in METRICS.items()},
    }


def server_info(client: Client) -> dict[str, Any]:
    for path in ("/server_info", "/get_server_info"):
        r = requests.get(client.url + path, timeout=60)
        if r.status_code == 200:
            return r.json()
    return {}


def pair(
    client: Client, tok: Any, ids: list[int], spans: list[list[int]], rep: int, args: Any
) -> dict[str, Any]:
    """Both forms of one prompt, in the order the repetition's parity gives."""
    out: dict[str, Any] = {}
    for form in ("plain", "chunked") if rep % 2 == 0 else ("chunked", "plain"):
        chunk_spans = spans if form == "chunked" else None
        out[form] = trial(client, tok, ids, chunk_spans, args.lead, args.tail)
    c, p = out["chunked"], out["plain"]
    out["gap_ratio"] = c["gap_s"] / p["gap_s"]
    out["stretch_ratio"] = c["stretch_s"] / p["stretch_s"]
    m = c["metrics"]
    out["check"] = (
        m["split_requests"] == 1 and m["fallbacks"] == 0 and m["failures"] == 0 and m["misses"] > 0
    )
    return out


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str, form: str | None = None) -> float:
        return statistics.median(r[form][key] if form else r[key] for r in records)

    return {
        "gap_ratio_median": med("gap_ratio"),
        "stretch_ratio_median": med("stretch_ratio"),
        "gap_ratio_max": max(r["gap_ratio"] for r in records),
        "plain_gap_s_median": med("gap_s", "plain"),
        "chunked_gap_s_median": med("gap_s", "chunked"),
        "itl_s_median": med("itl_s", "plain"),
        "checks_ok": all(r["check"] for r in records),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, for a sanity run")
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=8100, help="cold prompt, at most")
    ap.add_argument("--passage-tokens", type=int, default=600, help="truncate passages (0: no)")
    ap.add_argument("--lead", type=int, default=24, help="tokens decoded before the prompt")
    ap.add_argument("--tail", type=int, default=8, help="tokens decoded after it")
    ap.add_argument("--server-args", default="", help="extra flags for both servers")
    ap.add_argument("--ref-root", type=Path, default=None, help="another checkout's server too")
    add_data_option(ap, as_path=True)
    add_out_option(ap, "itl.json")
    args = ap.parse_args()
    reps = 1 if args.quick else args.repetitions
    commit, dirty = git_state()
    tok = embedded_tokenizer()
    passages = Passages(args.data, args.passage_tokens)
    roots = {"this": ROOT}
    if args.ref_root is not None:
        roots["ref"] = args.ref_root.resolve()
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in roots}
    info: dict[str, Any] = {}
    with ExitStack() as stack:
        clients: dict[str, Client] = {}
        for name, root in roots.items():
            disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="sgl_pic_itl_"))
            flags = [*shlex.split(args.server_args), "--pic-disk-cache-dir", disk]
            clients[name] = stack.enter_context(launch(flags, root=root))
            # Whatever ends the run, a paused server is resumed before it is stopped.
            stack.callback(clients[name].resume)
            sa = server_info(clients[name])
            info[name] = {
                "root": str(root),
                "git": git_state(root=root)._asdict(),
                "chunked_prefill_size": sa.get("chunked_prefill_size"),
                "max_prefill_tokens": sa.get("max_prefill_tokens"),
            }
            clients[name].pause()
        # A fresh server's first large forwards pay a one-time cost: one unrecorded pair.
        for rep in range(-1, reps):
            ids, spans = passages.prompt(tok, args.prompt_tokens)
            for name, client in clients.items():
                client.resume()
                try:
                    out = pair(client, tok, ids, spans, rep, args)
                finally:
                    client.pause()
                if rep >= 0:
                    out["repetition"] = rep
                    records[name].append(out)
                print(
                    f"{name} rep {rep}: {len(ids)} tokens, {len(spans)} chunks; longest gap "
                    f"plain {out['plain']['gap_s']:.2f} s, chunked {out['chunked']['gap_s']:.2f} s "
                    f"(x{out['gap_ratio']:.2f}); itl {out['plain']['itl_s']:.3f} s; "
                    f"check {out['check']}",
                    flush=True,
                )
    report: dict[str, Any] = {
        "git_commit": commit,
        "git_dirty": dirty,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "servers": info,
        "summary": {name: summary(recs) for name, recs in records.items()},
        "records": records,
    }
    if "ref" in records:
        report["compare"] = {
            "chunked_gap_this_over_ref": [
                a["chunked"]["gap_s"] / b["chunked"]["gap_s"]
                for a, b in zip(records["this"], records["ref"], strict=True)
            ],
        }
    path = write_json(args.out, report)
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {path}")
    if not all(s["checks_ok"] for s in report["summary"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
