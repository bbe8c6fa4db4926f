"""The server launched as SGLang's users launch it: a hub id served from an offline Hugging
Face cache, a weight update from disk while serving, and weights with no identity.

One server serves the hub id and both updates (launches are the costly part of a test);
the second is the launch that must come up with reuse off rather than die.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import requests

from tests.support.prompts import body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang

REPO = "sgl-pic-test/SmolLM2-135M-Instruct"
HITS = ('sgl_pic_chunk_hits_total{kind="contiguous"}', 'sgl_pic_chunk_hits_total{kind="disjoint"}')
TIERS = ("device", "host", "disk")


def hub_cache(cache: Path, model: Path) -> Path:
    """``model`` as huggingface_hub caches a download of ``REPO``: files link to
    ``blobs/``, the weights' blob named by its SHA-256 (hard links: no 500 MB copy)."""
    repo = cache / ("models--" + REPO.replace("/", "--"))
    revision = "0" * 40
    snap, blobs = repo / "snapshots" / revision, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(model.iterdir()):
        h = hashlib.sha256() if f.suffix == ".safetensors" else hashlib.sha1()
        with open(f, "rb") as src:
            while block := src.read(1 << 22):
                h.update(block)
        blob = blobs / h.hexdigest()
        try:
            os.link(f, blob)
        except OSError:
            shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snap


def other_weights(model: Path, out: Path) -> Path:
    """A copy of ``model`` with one layer's key projection scaled: other KV."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    tensors = load_file(str(model / "model.safetensors"))
    name = next(k for k in sorted(tensors) if k.endswith("self_attn.k_proj.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hits(s: Server, chunks: list[str], question: str) -> tuple[float, dict[str, float]]:
    sent = s.send(body(*chunked(chunks, question)))
    by_tier = {t: sent.delta[f'sgl_pic_tier_hits_total{{tier="{t}"}}'] for t in TIERS}
    return sum(sent.delta[h] for h in HITS), by_tier


def update(s: Server, model_path: str) -> None:
    r = requests.post(
        s.url + "/update_weights_from_disk", json={"model_path": model_path}, timeout=300
    )
    assert r.status_code == 200 and r.json()["success"], r.text


def test_a_hub_id_serves_reuse_and_a_weight_update_leaves_no_old_kv(
    embedded_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Launched by hub id from an offline cache, the server reuses a reordered prompt's
    chunks. After ``/update_weights_from_disk`` to other weights, a request that hit before
    gets 0 hits from every tier; updated back to the launch weights, it finds the records
    those weights left in the host and disk tiers (chunks are keyed by content)."""
    cache = tmp_path / "hf"
    hub_cache(cache, Path(embedded_path))
    changed = other_weights(Path(embedded_path), tmp_path / "changed")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with launch("--model-path", REPO) as s:
        assert hits(s, ["A", "B", "C"], "Which city is in Japan?")[0] == 0
        assert hits(s, ["C", "A", "B"], "Which city is on the equator?")[0] == 3

        update(s, str(changed))
        n, by_tier = hits(s, ["B", "C", "A"], "Which city has wooden temples?")
        assert n == 0 and by_tier == dict.fromkeys(TIERS, 0), by_tier
        assert s.metrics()['sgl_pic_weight_updates_total{source="disk"}'] == 1

        update(s, REPO)  # the launch weights again: their records are still stored
        n, by_tier = hits(s, ["A", "C", "B"], "Which city lies where two rivers meet?")
        assert n == 3 and by_tier["device"] == 0, by_tier
        health = requests.get(s.url + "/health", timeout=30)
        assert health.status_code == 200


def test_weights_with_no_identity_serve_plain_sglang(embedded_path: str) -> None:
    """``--load-format dummy`` loads random weights each launch: nothing may be keyed by
    them. The scheduler comes up with reuse off, says why once, and serves."""
    with launch("--model-path", embedded_path, "--load-format", "dummy") as s:
        assert s.metrics().get('sgl_pic_unsupported{reason="model_identity"}') == 1.0
        sent = s.send(body(*chunked(["A", "B"], "Which city is in Japan?")))
        assert sum(sent.delta[h] for h in HITS) == 0
        assert sent.out["meta_info"]["completion_tokens"] > 0
        log = s.log_tail(400)
        assert "--load-format dummy" in log and "chunk reuse is off" in log, log
