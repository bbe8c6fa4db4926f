"""What taking the weights' identity costs a server at start-up, on a large sharded
checkpoint: the first launch on a machine, a second launch, and two ranks at once.

    python bench/identity_startup.py [--gib 16] [--shards 4] [--out FILE]

The checkpoint is ``--shards`` sparse ``.safetensors`` files of ``--gib`` GiB in all (they
take no disk space; their bytes read as zeros, so hashing them costs what hashing real
weights of that size costs once they are in the page cache). Each launch is a fresh
process calling ``model_identity`` as the plugin does at start-up, with the digest cache of
that run, and reports its wall time and how many files it hashed in full. Then two
processes start together on an empty digest cache, as the ranks of one server do: the pair
hashes each file once between them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, git_state, write_json

CHILD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from sgl_pic.file_digests import FileDigests
from sgl_pic.model_identity import model_identity
t = time.perf_counter()
d = FileDigests(Path({cache!r}))
ident = model_identity({model!r}, d)
print(json.dumps({{"seconds": time.perf_counter() - t, "hashed": d.hashed, "identity": ident}}))
"""


def checkpoint(root: Path, gib: float, shards: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    size = int(gib * 2**30 / shards)
    for i in range(shards):
        with open(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.truncate(size)
    return root


def launch(model: Path, cache: Path, n: int = 1) -> list[dict]:
    """``n`` launches started together; each one's report."""
    code = CHILD.format(root=str(ROOT), cache=str(cache), model=str(model))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    return [json.loads(p.communicate()[0]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "bench/results/identity_startup.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sgl_pic_identity_") as tmp:
        model = checkpoint(Path(tmp) / "model", args.gib, args.shards)
        cache = Path(tmp) / "digests"
        first = launch(model, cache)[0]
        second = launch(model, cache)[0]
        # A machine that never hashed them: two ranks start together.
        ranks = launch(model, Path(tmp) / "digests_ranks", 2)
    same = first["identity"] == second["identity"] == ranks[0]["identity"] == ranks[1]["identity"]
    state = git_state()
    result = {
        "commit": state.commit,
        "dirty": state.dirty,
        "gib": args.gib,
        "shards": args.shards,
        "first_launch": first,
        "second_launch": second,
        "two_ranks_together": ranks,
        "same_identity": same,
    }
    write_json(args.out, result)
    print(f"{args.gib:g} GiB in {args.shards} shards")
    print(f"first launch:  {first['seconds']:.2f} s, {first['hashed']} files hashed")
    print(f"second launch: {second['seconds']:.3f} s, {second['hashed']} files hashed")
    print(
        "two ranks together: "
        + ", ".join(f"{r['seconds']:.2f} s ({r['hashed']} hashed)" for r in ranks)
    )
    print(f"same identity everywhere: {same}")


if __name__ == "__main__":
    main()
