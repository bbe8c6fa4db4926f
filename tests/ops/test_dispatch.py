"""The public ops: backend choice, and results equal to the reference on CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import sgl_pic.ops as ops
from sgl_pic.ops import reference
from sgl_pic.rope import default_inv_freq


def test_cpu_tensors_run_the_reference(rand_kv, distinct, gen) -> None:
    src = rand_kv(2, 30, 3, 64, dtype=torch.bfloat16)
    pool = rand_kv(2, 40, 3, 64, dtype=torch.bfloat16)
    tokens, slots = distinct(20, 30), distinct(20, 40)
    positions = torch.randint(0, 10_000, (20,), generator=gen)
    inv_freq = default_inv_freq(64, 10000.0)

    expected = pool.clone()
    reference.gather_kv(src, tokens, expected, slots)
    reference.apply_rope_kv(expected, positions, inv_freq, "interleaved", slot_ids=slots)

    got = list(pool.clone().unbind(0))
    assert ops.gather_kv(src, tokens, got, slots) == ops.OpResult("reference")
    result = ops.apply_rope_kv(got, positions, inv_freq, "interleaved", slot_ids=slots)
    assert result.backend == "reference"
    assert torch.equal(torch.stack(got), expected)


def test_cuda_status_is_a_reason_not_an_error() -> None:
    state = ops.cuda_status()
    assert isinstance(state, ops.CudaStatus)
    if not torch.cuda.is_available():
        assert not state.available
        assert "no CUDA device" in state.reason


def test_import_needs_no_nvcc_and_builds_nothing() -> None:
    code = (
        "import sgl_pic, sgl_pic.ops, sgl_pic.ops.cuda as c; "
        "assert c._status is None and c._lib is None"
    )
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "op",
    [ops.gather_kv, ops.gather_kv_layer, ops.scatter_kv, ops.scatter_kv_layer],
)
def test_copy_ops_share_reference_signature(op) -> None:
    import inspect

    assert inspect.signature(op) == inspect.signature(getattr(reference, op.__name__))


@pytest.mark.parametrize(
    "op",
    [ops.apply_rope_kv, ops.apply_rope_kv_layer, ops.rerotate_kv, ops.rerotate_kv_layer],
)
def test_rope_ops_share_reference_signature(op) -> None:
    import inspect

    assert inspect.signature(op) == inspect.signature(getattr(reference, op.__name__))


def test_errors_name_the_arguments_as_written(rand_kv) -> None:
    k = rand_kv(2, 10, 3, 64, dtype=torch.float32)
    inv_freq = default_inv_freq(64, 10000.0)
    ok, short = torch.arange(10), torch.arange(9)
    for module in (ops, reference):
        with pytest.raises(ValueError, match="new_positions"):
            module.rerotate_kv(k, ok, short, inv_freq)
        with pytest.raises(ValueError, match="old_positions"):
            module.rerotate_kv_layer(k[0], short, ok, inv_freq)
        with pytest.raises(ValueError, match="^positions"):
            module.apply_rope_kv(k, short, inv_freq)
