"""Where a workload's time goes: py-spy samples of the scheduler process, prefix caching
against sgl-pic, on the first ``--requests`` requests of one ``bench/workloads.py`` stream.

Each stack sample is put in one bucket: decode, or an extend forward by who ran it
(SGLang's own extend, or sgl-pic's assembly, phase 1, query probe, phase 2) and by what it
was doing (the query probe's scoring, MLP, QKV projection and RoPE, the attention kernel,
the output projection, chunk storage and KV copies, the rest of the layer). Seconds are
samples over the rate. With the tokens each side computed (prefix caching: prompt less
cached; sgl-pic: phase 1 and phase 2 tokens, ``sgl_pic_encoded_tokens_total`` and
``..._recomputed_tokens_total``), the buckets give a cost per computed token, which says
which part of the forward sgl-pic pays more for than SGLang does.

``extend_parts`` puts that against the ideal of ``bench/workloads.py``: each part's
seconds in sgl-pic's extend forwards (all stages together; assembly and the query probe
also on their own) next to prefix caching's seconds of that part scaled by the ratio of
computed tokens, which is what the part would cost at SGLang's per-token rate.
``stages`` splits the same seconds by who ran them (assembly, phase 1, probe, phase 2,
and ``sglang_extend``: the forward's frames outside those, the LM head's logits above all,
and requests that ran without reuse), each also over the ideal's total: phase 2 alone
against the ideal says what the recomputed tokens cost before any other overhead.
``keys_per_query`` is the attention work per computed token: keys each query attends (a
query at position p attends p + 1), averaged over prefix caching's computed tokens (from
each request's prompt and cached lengths) and over each phase's tokens
(``sgl_pic_phase_attended_keys_total`` over ``sgl_pic_phase_forward_tokens_total``).

Needs ``py-spy`` (``pip install py-spy``; not a project dependency). Results:
``bench/results/profile_<workload>.json`` with the commit and dirty flag; ``--raw-dir``
keeps py-spy's raw stacks (``<config>.txt``, one folded stack and its count per line) for a
closer look at a bucket.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA, RESULTS, git_state, write_json  # noqa: E402
from _server import delta, launch, metric  # noqa: E402
from workload_streams import WORKLOADS, Request, Streams, server_warmup  # noqa: E402
from workloads import (  # noqa: E402
    MAX_NEW_TOKENS,
    PASSAGE_TOKENS,
    SERVER_ARGS,
    config_flags,
    config_form,
    model_flags,
    run_stream,
    warm_up,
)

RATE = 50  # samples per second

# (bucket, frame names any of which marks it), first match wins, within an extend forward.
PARTS = [
    # The probe's scoring runs in a hook inside the attention module: without its own
    # bucket it fell to the rest of the layer.
    ("scoring", ("QueryProbe.after_attention",)),
    ("mlp", ("LlamaMLP.forward",)),
    ("attn_kernel", ("grouped_forward_extend", "_run_sdpa_forward_extend")),
    ("qkv_rope", ("forward_prepare_native",)),
    ("o_proj", ("RowParallelLinear",)),
    ("store_kv", ("cachetune_ranking", "put_chunk", "NodeWriter.write", "KVAccess")),
    ("layer_other", ("LlamaDecoderLayer",)),
]
# The chunk path's steps (sgl_pic.engine); selection ran inside phase 2 before the steps
# were split out, so Select.run stays in that stage.
STAGES = [
    ("probe", "Signals.run"),
    ("phase1", "Phase1.run"),
    ("phase2", "Select.run"),
    ("phase2", "Phase2.run"),
    ("assemble", "Assemble.run"),
]


def bucket(stack: str) -> str:
    if "_execute_decode" in stack:
        return "decode"
    if "ModelRunner.forward" not in stack:
        return "outside_forward"
    stage = next((name for name, frame in STAGES if frame in stack), "sglang_extend")
    if stage == "assemble":
        return stage
    part = next((p for p, frames in PARTS if any(f in stack for f in frames)), "other")
    return f"{stage}.{part}"


def seconds_by_bucket(raw: Path) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        counts[bucket(stack)] += int(n)
    return {k: v / RATE for k, v in sorted(counts.items())}


def profile(
    args: argparse.Namespace, sessions: list, config: str, raw: Path, warmup: list[Request]
) -> dict[str, Any]:
    form = config_form(config)
    with launch(config_flags(SERVER_ARGS + model_flags(args.workload), config)) as client:
        warm_up(client, warmup)  # before sampling: a fresh server's one-time cost
        found = subprocess.run(
            ["pgrep", "-f", "sglang::scheduler"], capture_output=True, text=True, check=True
        ).stdout.split()
        if len(found) != 1:
            raise RuntimeError(f"expected one scheduler process, found {found}")
        spy = subprocess.Popen(
            ["py-spy", "record", "--pid", found[0], "--format", "raw", "-o", str(raw)]
            + ["--rate", str(RATE), "--nonblocking"]
        )
        time.sleep(2)
        before = client.metrics()
        res = run_stream(client, sessions, form, args.concurrency, args.window)
        d = delta(before, client.metrics())
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=300)
    computed = res["prompt_tokens"] - res["prefix_cached_tokens"]
    if form != "pic":
        # SGLang's extend: each request's tokens past its cached prefix. (Imported here:
        # the module imports torch, and --help answers without it.)
        from sgl_pic.core.runs import SubRequest, attended_keys

        subs = [SubRequest(0, r["cached"], r["prompt"] - r["cached"]) for r in res["records"]]
        keys_per_query = {"extend": attended_keys(subs) / max(computed, 1)}
    else:
        keys_per_query = {
            p: metric(d, "sgl_pic_phase_attended_keys_total", phase=p)
            / max(metric(d, "sgl_pic_phase_forward_tokens_total", phase=p), 1)
            for p in ("phase1", "probe", "phase2")
        }
        # Phase 1 runs the missed chunks' tokens, phase 2 the recomputed ones (some of the
        # former again); requests that ran without reuse count as SGLang's extend does.
        computed = int(
            metric(d, "sgl_pic_encoded_tokens_total")
            + metric(d, "sgl_pic_recomputed_tokens_total")
            + computed
            - metric(d, "sgl_pic_new_tokens_total")
        )
    return {
        "wall_s": res["wall_s"],
        "prompt_tokens": res["prompt_tokens"],
        "prefix_cached_tokens": res["prefix_cached_tokens"],
        "computed_tokens": computed,
        "keys_per_query": keys_per_query,
        "seconds": seconds_by_bucket(raw),
    }


def extend_parts(base: dict[str, Any], pic: dict[str, Any]) -> dict[str, Any]:
    """Each part of sgl-pic's extend forwards against the same part of prefix caching's,
    scaled by the computed tokens (module docstring); seconds."""
    work = pic["computed_tokens"] / max(base["computed_tokens"], 1)
    parts = [p for p, _ in PARTS] + ["other"]
    out: dict[str, Any] = {"work_ratio": work}
    for part in parts:
        mine = sum(v for k, v in pic["seconds"].items() if k.split(".")[-1] == part and "." in k)
        ideal = base["seconds"].get(f"sglang_extend.{part}", 0.0) * work
        out[part] = {"sgl_pic_s": round(mine, 2), "ideal_s": round(ideal, 2)}
    out["assemble"] = {"sgl_pic_s": pic["seconds"].get("assemble", 0.0), "ideal_s": 0.0}
    total = sum(v for k, v in pic["seconds"].items() if "." in k or k == "assemble")
    base_total = sum(v for k, v in base["seconds"].items() if k.startswith("sglang_extend."))
    out["total"] = {"sgl_pic_s": round(total, 2), "ideal_s": round(base_total * work, 2)}
    ideal = max(base_total * work, 1e-9)
    out["stages"] = {}
    for stage in [*dict.fromkeys(name for name, _ in STAGES), "sglang_extend"]:
        mine = sum(v for k, v in pic["seconds"].items() if k == stage or k.startswith(stage + "."))
        out["stages"][stage] = {"sgl_pic_s": round(mine, 2), "over_ideal": round(mine / ideal, 3)}
    out["of_which_probe_s"] = out["stages"]["probe"]["sgl_pic_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="agent", choices=sorted(WORKLOADS))
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--raw-dir", default=None, help="keep py-spy's raw stacks here")
    args = ap.parse_args()
    commit, dirty = git_state()
    src = Streams(DEFAULT_DATA, PASSAGE_TOKENS, MAX_NEW_TOKENS)
    sessions = WORKLOADS[args.workload](src, args.requests, args.seed)
    warmup = server_warmup(src, args.concurrency)
    report: dict[str, Any] = {"git_commit": commit, "git_dirty": dirty, "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        raw_dir = Path(args.raw_dir or tmp)
        raw_dir.mkdir(parents=True, exist_ok=True)
        for config in ("prefix_caching", "sgl_pic"):
            print(f"== {args.workload} / {config}", flush=True)
            raw = raw_dir / f"{config}.txt"
            report[config] = profile(args, sessions, config, raw, warmup)
    for config in ("prefix_caching", "sgl_pic"):
        r = report[config]
        ms = {k: 1000 * v / max(r["computed_tokens"], 1) for k, v in r["seconds"].items()}
        r["ms_per_computed_token"] = ms
        print(config, json.dumps({k: round(v, 3) for k, v in ms.items()}), flush=True)
    report["extend_parts"] = extend_parts(report["prefix_caching"], report["sgl_pic"])
    print("extend parts", json.dumps(report["extend_parts"]), flush=True)
    for config in ("prefix_caching", "sgl_pic"):
        kpq = {k: round(v, 1) for k, v in report[config]["keys_per_query"].items()}
        print(config, "keys per query", kpq, flush=True)
    out = write_json(args.out or RESULTS / f"profile_{args.workload}.json", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
