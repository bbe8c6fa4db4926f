"""``--pic-check`` at server start: a configuration that fails the gate serves every request
as exact prefill, with the refusal in the metrics, and marks are not honoured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.prompts import body, chunked
from tests.support.server import Server, launch

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def refused() -> Iterator[Server]:
    # Reusing everything fails the gate's KL check on the embedded model.
    with launch("--pic-check", "--pic-policy", "full_reuse") as s:
        yield s


def test_failed_gate_refuses_reuse_and_serves_exact_prefill(refused: Server) -> None:
    metrics = refused.metrics()
    assert metrics.get('sgl_pic_unsupported{reason="model_check"}') == 1.0, metrics
    toks, spans = chunked(["A", "B", "C"], "Which city is on the equator?")
    plain = refused.generate(body(toks, None))
    assert plain.status_code == 200, plain.text
    for _ in range(2):  # the second time every chunk would be a hit
        marked = refused.generate(body(toks, spans))
        assert marked.status_code == 200, marked.text
        assert marked.json()["output_ids"] == plain.json()["output_ids"]
    after = refused.metrics()
    assert after.get("sgl_pic_chunk_lookups_total", 0.0) == 0.0
    assert after.get("sgl_pic_reused_tokens_total", 0.0) == 0.0
    log = Path(refused.log_path).read_text()
    assert "verdict: FAIL: reuse refused" in log
    assert "chunk reuse is off (model_check): the model failed --pic-check: kl:" in log
