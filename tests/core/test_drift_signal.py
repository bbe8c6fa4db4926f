"""The served drift signal (``core.drift_signal``) on SGLang's own logits output and
metadata classes: the executor's rows get their first-token entropy in ``customized_info``
(SGLang's channel into ``meta_info``), other rows None, nothing for decode batches, and a
mark never outlives its forward."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_pic.binding.model_hooks import _logits_metadata
from sgl_pic.binding.runtime import PicRuntime
from sgl_pic.core.drift_signal import META_KEY, DriftSignal, entropy

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True, scope="module")
def _cpu_stubs() -> None:
    """SGLang's logits module imports its config modules, which need the CPU stand-ins
    (torchvision): active here, not only when an earlier test module activated them."""
    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()


def sglang_output(logits: torch.Tensor) -> Any:  # logits: [n, vocab]
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    return LogitsProcessorOutput(next_token_logits=logits)


def metadata(extend: bool) -> Any:
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return LogitsMetadata(forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE)


def test_entropy() -> None:
    flat = entropy(torch.zeros(2, 8))
    assert flat.tolist() == pytest.approx([math.log(8)] * 2)
    peaked = entropy(torch.tensor([[30.0, 0.0, 0.0, 0.0]]))
    assert float(peaked[0]) < 1e-9
    p = torch.tensor([0.5, 0.25, 0.25])
    assert float(entropy(p.log()[None])[0]) == pytest.approx(float(-(p * p.log()).sum()))
    # Masked tokens (-inf logits, e.g. a padded vocabulary) have probability 0: they add
    # nothing, and the entropy is that of the rest, not NaN.
    masked = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]])
    assert entropy(masked).tolist() == pytest.approx([math.log(2)])


def test_served_rows_get_their_entropy_and_others_none() -> None:
    seen: list[float] = []
    drift = DriftSignal(seen.append)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0]])
    out = sglang_output(logits)
    drift.mark([0, 2])
    drift.on_logits(metadata(extend=True), out)
    column = out.customized_info[META_KEY]
    assert column[1] is None
    assert column[0] == pytest.approx(math.log(4))
    assert column[2] == pytest.approx(float(entropy(logits[2:])[0]))
    assert seen == [column[0], column[2]]
    # The mark was taken: the next output gets nothing.
    again = sglang_output(logits)
    drift.on_logits(metadata(extend=True), again)
    assert again.customized_info is None


def test_a_decode_batch_takes_the_mark_and_gets_nothing() -> None:
    drift = DriftSignal(lambda _v: None)
    drift.mark([0])
    out = sglang_output(torch.zeros(1, 4))
    drift.on_logits(metadata(extend=False), out)
    assert out.customized_info is None
    later = sglang_output(torch.zeros(1, 4))
    drift.on_logits(metadata(extend=True), later)
    assert later.customized_info is None


def test_the_models_own_customized_info_is_kept() -> None:
    drift = DriftSignal(lambda _v: None)
    out = sglang_output(torch.zeros(2, 4))
    out.customized_info = {"model_key": [1, 2]}
    drift.mark([1, 5])  # a row past the output's is ignored
    drift.on_logits(metadata(extend=True), out)
    assert out.customized_info["model_key"] == [1, 2]
    assert out.customized_info[META_KEY][0] is None
    assert out.customized_info[META_KEY][1] == pytest.approx(math.log(4))


def test_the_hook_reads_logits_metadata_where_sglangs_forward_takes_it() -> None:
    from sglang.srt.layers.logits_processor import LogitsProcessor

    params = list(inspect.signature(LogitsProcessor.forward).parameters)
    assert params[:5] == ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata"]
    md = object()
    assert _logits_metadata(("ids", "hidden", "head", md), {}) is md
    assert _logits_metadata(("ids", "hidden", "head"), {"logits_metadata": md}) is md


class Executor:
    def __init__(self, served: tuple[int, ...], hidden: torch.Tensor | None) -> None:
        self.served = served
        self.hidden = hidden
        self.served_rows: tuple[int, ...] = ()

    def forward(self, stack: Any, ids: Any, fb: Any, handoff: Any) -> torch.Tensor | None:
        self.served_rows = self.served if self.hidden is not None else ()
        return self.hidden


def test_the_runtime_marks_what_the_executor_served() -> None:
    drift = DriftSignal(lambda _v: None)
    gate = SimpleNamespace(marks=None)
    phases = SimpleNamespace(context=None)
    fb = SimpleNamespace(extend_prefix_lens_cpu=[0, 0])
    served = PicRuntime(gate, None, Executor((1,), torch.zeros(2, 3)), phases, drift)  # type: ignore[arg-type]
    served.on_extend(None, torch.tensor([1, 2]), torch.tensor([0, 1]), fb)  # type: ignore[arg-type]
    out = sglang_output(torch.zeros(2, 4))
    served.on_logits(metadata(extend=True), out)
    assert out.customized_info[META_KEY][0] is None
    assert out.customized_info[META_KEY][1] == pytest.approx(math.log(4))
    # A forward the executor left to SGLang clears an earlier mark.
    drift.mark([0])
    plain = PicRuntime(gate, None, Executor((), None), phases, drift)  # type: ignore[arg-type]
    plain.on_extend(None, torch.tensor([1]), torch.tensor([0]), fb)  # type: ignore[arg-type]
    out = sglang_output(torch.zeros(1, 4))
    plain.on_logits(metadata(extend=True), out)
    assert out.customized_info is None
