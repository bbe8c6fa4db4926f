"""The launcher's argument handling (no server is started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sgl_pic.binding.settings import PicServerSettings
from sgl_pic.cli.launch_server import _flag_value, build
from sgl_pic.config import PicConfig

MODEL = ["--model-path", "/some/model"]
ROOT = Path(__file__).resolve().parents[2]


def test_reuse_flags_are_added_unless_given() -> None:
    argv, ns, config = build([*MODEL, "--pic-policy", "epic", "--pic-host-cache-mb", "0"])
    assert _flag_value(argv, "--radix-cache-backend") == "sgl_pic"
    # SGLang's own backend choice is kept (on the CPU, main() adds torch_native with the
    # other CPU defaults); the chunk path runs on whichever it selects.
    assert _flag_value(argv, "--attention-backend") is None
    assert "--enable-metrics" in argv
    assert not any(a.startswith("--pic-") for a in argv)  # ours never reach SGLang
    assert config.policy == "epic" and ns.pic_host_cache_mb == 0

    argv, _, _ = build([*MODEL, "--attention-backend", "flashinfer", "--page-size", "16"])
    assert _flag_value(argv, "--attention-backend") == "flashinfer"
    assert build([*MODEL, "--page-size", "16"])[2].page_size == 16


def test_disable_serves_plain_sglang() -> None:
    argv, _, _ = build([*MODEL, "--pic-disable"])
    assert _flag_value(argv, "--radix-cache-backend") is None
    assert _flag_value(argv, "--attention-backend") is None


@pytest.mark.parametrize(
    "bad",
    [
        {"device_cache_fraction": 1.5},
        {"host_cache_mb": -1},
        {"feed_mode": "cuda"},
        {"eviction": "mru"},
        {"admission": "never"},
        {"calibrate": True, "host_cache_mb": 0, "disk_cache_dir": ""},
        {"public_namespaces": ["corpus"]},
    ],
)
def test_bad_server_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        PicServerSettings(PicConfig(), **bad)


def test_settings_travel_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    s = PicServerSettings(PicConfig(policy="cachetune"), "/m", 0.25, 64, "/tmp/d", 128, True)
    monkeypatch.delenv("SGLPIC_SETTINGS", raising=False)
    s.to_env()
    assert PicServerSettings.from_env() == s


def test_eviction_policy_reaches_the_settings() -> None:
    assert build(MODEL)[1].pic_eviction == "gdsf"  # the default keeps the hot set
    _, ns, _ = build([*MODEL, "--pic-eviction", "lru"])
    assert ns.pic_eviction == "lru"
    assert PicServerSettings(PicConfig(), eviction=ns.pic_eviction).eviction == "lru"
    with pytest.raises(SystemExit):
        build([*MODEL, "--pic-eviction", "mru"])


def test_public_namespaces_reach_the_scheduler_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_pic.core.tenants import TenantPolicy, tenant_policy

    assert build(MODEL)[1].pic_public_namespaces == ""  # tenants share nothing by default
    _, ns, _ = build([*MODEL, "--pic-public-namespaces", "corpus,docs"])
    s = PicServerSettings(PicConfig(), public_namespaces=ns.pic_public_namespaces)
    monkeypatch.delenv("SGLPIC_SETTINGS", raising=False)
    s.to_env()  # what the scheduler process reads
    shared = TenantPolicy.from_names(["corpus", "docs"])
    assert tenant_policy(PicServerSettings.from_env()) == shared
    assert tenant_policy(PicServerSettings(PicConfig())).public == frozenset()


def test_admission_mode_reaches_the_settings() -> None:
    assert build(MODEL)[1].pic_admission == "adaptive"
    _, ns, _ = build([*MODEL, "--pic-admission", "second_sight"])
    assert PicServerSettings(PicConfig(), admission=ns.pic_admission).admission == "second_sight"
    with pytest.raises(SystemExit):
        build([*MODEL, "--pic-admission", "never"])


@pytest.mark.sglang
def test_chunk_starts_are_padded_to_the_page_size_sglang_resolved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # SGLang may raise --page-size while resolving (e.g. for trtllm_mha); its decision
    # sits in the record's declarations, not in argv.
    from types import SimpleNamespace

    from sgl_pic.cli.launch_server import launch_check

    _, _, config = build([*MODEL, "--page-size", "16"])
    args = SimpleNamespace(attention_backend="triton", page_size=16)
    args._resolved_overrides = [("_mla_backend_page_constraints", {"page_size": 64})]
    with caplog.at_level("INFO"):
        assert launch_check(args, config).page_size == 64
    assert "leave chunk reuse on" in caplog.text and "page size 64" in caplog.text
    assert "resolved --page-size 64 (asked: 16)" in caplog.text
    args._resolved_overrides.append(("user", {"attention_backend": "trtllm_mha"}))
    with caplog.at_level("INFO"):
        launch_check(args, config)
    assert "chunk reuse will be off (backend)" in caplog.text
    assert "lifted by --attention-backend" in caplog.text
    # Chunks encoded after their context need a page of one token: a launch SGLang gives
    # another page size stops with why, not a traceback.
    _, _, config = build([*MODEL, "--pic-chunk-context", "first_chunk"])
    with pytest.raises(SystemExit, match="needs page size 1.*resolved --page-size 64"):
        launch_check(args, config)
    with pytest.raises(SystemExit):
        build([*MODEL, "--pic-chunk-context", "first_chunk", "--page-size", "16"])


@pytest.mark.sglang
def test_grpc_launches_resolve_as_sglangs_launcher_resolves_them() -> None:
    # SGLang's run_server seeds tokenizer_path for its gRPC servers before resolution seals
    # the record; resolving earlier without it would leave them no tokenizer path.
    from sgl_pic.binding.cpu_env import activate_cpu_stubs
    from sgl_pic.cli.launch_server import resolve_server_args
    from sgl_pic.model.embedded import ensure_embedded_model

    activate_cpu_stubs()  # as the launcher does on the CPU
    model = str(ensure_embedded_model().path)
    argv = ["--model-path", model, "--device", "cpu", "--grpc-mode"]
    assert resolve_server_args(argv, reuse=False)[0].tokenizer_path == model


def cuda_launch(gpu: str, mode: str, *argv: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.cuda_args", gpu, mode, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return {**json.loads(lines[-1]), "log": out.stderr}


@pytest.mark.sglang
def test_a_default_launch_on_a_cuda_gpu_serves_reuse_with_prefill_graphs() -> None:
    # SGLang resolves breakable prefill CUDA graphs by default on CUDA; the chunk path runs
    # beside them (its batches are kept off the graph), so the check accepts.
    got = cuda_launch("h100", "sglang")
    assert got["prefill_graph"] == "breakable" and got["attention"][0] == "fa3"
    assert (got["reason"], got["detail"]) == ("", "")
    assert got["config_page_size"] == got["pool_page_size"] == 1


@pytest.mark.sglang
def test_a_default_launch_on_blackwell_serves_reuse_at_the_pools_page_size() -> None:
    # SGLang's default there is trtllm_mha, which also raises the page size to 64; the
    # launcher names a covered backend instead, and pads chunk starts to the page size
    # SGLang resolved.
    got = cuda_launch("b200", "launcher")
    assert got["attention"][0] == "flashinfer" and got["prefill_graph"] == "breakable"
    assert "serving with --attention-backend flashinfer" in got["log"]
    assert (got["reason"], got["detail"]) == ("", "")
    assert got["config_page_size"] == got["pool_page_size"] == got["page_size"]


@pytest.mark.sglang
def test_a_default_launch_on_blackwell_keeps_sglangs_backend_for_a_model_reuse_refuses(
    tmp_path: Path,
) -> None:
    # GPT-OSS: hybrid sliding-window attention, which the chunk path refuses whatever the
    # backend, and SGLang serves it with its own backends only (FlashInfer would fail its
    # assertion). The launcher keeps SGLang's trtllm_mha and says why.
    from tests.support.cuda_args import write_hybrid_swa_model

    model = write_hybrid_swa_model(tmp_path / "gpt-oss")
    got = cuda_launch("b200", "launcher", "--model-path", str(model))
    assert got["attention"][0] == "trtllm_mha"
    assert (
        "keeping SGLang's attention backend (trtllm_mha prefill, trtllm_mha decode): "
        "chunk reuse will be off for this model (hybrid)" in got["log"]
    )
    assert "serving with --attention-backend" not in got["log"]
    # The launch self-check and the scheduler's name the model, not a flag that won't help.
    assert "chunk reuse will be off (hybrid)" in got["log"]
    assert "lifted by --attention-backend" not in got["log"]
    assert got["reason"] == "hybrid" and "no server flag lifts it" in got["detail"]


@pytest.mark.sglang
def test_a_model_config_that_cannot_be_read_leaves_the_check_to_the_loaded_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The backend is then chosen as for a covered model, with why in the log.
    from types import SimpleNamespace

    from sgl_pic.binding.cpu_env import activate_cpu_stubs
    from sgl_pic.cli.launch_server import _model_support

    activate_cpu_stubs()
    with caplog.at_level("WARNING"):
        assert _model_support(SimpleNamespace(model_path="/no/such/model")) is None
    assert "could not read the model's config" in caplog.text


def test_fair_share_and_namespace_metric_flags_reach_the_scheduler_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = build(MODEL)[1]
    # Off by default: no caps, no per-namespace metrics.
    assert (ns.pic_namespace_device_fraction, ns.pic_namespace_host_mb) == (0.0, 0)
    assert (ns.pic_namespace_disk_mb, ns.pic_namespace_metrics) == (0, 0)
    assert PicServerSettings(PicConfig()).namespace_max_tokens(1000) == 0
    _, ns, _ = build(
        [
            *MODEL,
            *("--pic-namespace-device-fraction", "0.25", "--pic-namespace-host-mb", "64"),
            *("--pic-namespace-disk-mb", "512", "--pic-namespace-metrics", "8"),
        ]
    )
    s = PicServerSettings(
        PicConfig(),
        namespace_device_fraction=ns.pic_namespace_device_fraction,
        namespace_host_mb=ns.pic_namespace_host_mb,
        namespace_disk_mb=ns.pic_namespace_disk_mb,
        namespace_metrics=ns.pic_namespace_metrics,
    )
    monkeypatch.delenv("SGLPIC_SETTINGS", raising=False)
    s.to_env()
    got = PicServerSettings.from_env()
    assert got.namespace_max_tokens(1000) == 250 and got.namespace_max_tokens(2) == 1
    assert (got.namespace_host_mb, got.namespace_disk_mb, got.namespace_metrics) == (64, 512, 8)
    for bad in (
        {"namespace_device_fraction": 1.5},
        {"namespace_host_mb": -1},
        {"namespace_disk_mb": 1.5},
        {"namespace_metrics": -2},
    ):
        with pytest.raises(ValueError, match="namespace_"):
            PicServerSettings(PicConfig(), **bad)
