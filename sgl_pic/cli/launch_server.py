"""``python -m sgl_pic.launch_server``: SGLang's server with position-independent chunk reuse.

Takes every SGLang server argument plus the ``--pic-*`` ones below. With no model named it
serves the embedded SmolLM2-135M; with no GPU it adds SGLang's CPU flags (each only if not
given). ``--pic-disable`` serves plain SGLang through the same launcher (the baseline).

SGLang's arguments are resolved before anything starts: chunk starts are padded to the
page size SGLang resolved, and a self-check logs whether the resolved arguments leave the
chunk path on (each refusal names the flag that lifts it). SGLang's GPU defaults are kept,
prefill CUDA graphs included (batches with chunked requests run eagerly); only where no
attention backend was named and SGLang's default is one the chunk path does not cover
(trtllm_mha on Blackwell) is FlashInfer chosen instead, with a log line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import secrets
import sys
from typing import Any

from sgl_pic.config import MTAF_NAMES, PicConfig
from sgl_pic.engine.layer_feed import FEED_MODES
from sgl_pic.http.chat_chunks import AUTO_CHUNK_ROLES
from sgl_pic.registry import POLICIES
from sgl_pic.store.admission import ADMISSION_MODES
from sgl_pic.store.eviction import EVICTION_POLICIES

logger = logging.getLogger(__name__)

BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")

PIC_FLAGS: dict[str, str] = {
    # flag -> PicConfig field
    "--pic-policy": "policy",
    "--pic-r": "daric_r",
    "--pic-n-avg": "daric_n_avg",
    "--pic-mtaf": "daric_mtaf",
    "--pic-max-iters": "daric_max_iters",
    "--pic-epic-k": "epic_k",
    "--pic-cacheblend-ratio": "cacheblend_ratio",
    "--pic-cachetune-r": "cachetune_r",
    "--pic-alpha": "cachetune_alpha",
    "--pic-qa-ratio": "qa_ratio",
    "--pic-qa-min-tokens": "qa_min_tokens",
    "--pic-qa-sink-tokens": "qa_sink_tokens",
    "--pic-qa-layers": "qa_layers",
    "--pic-segment-tokens": "segment_tokens",
    "--pic-delimiter": "delimiter",
    "--pic-max-chunks": "max_chunks",
    "--pic-min-chunk-tokens": "min_chunk_tokens",
    "--pic-auto-chunk-min-tokens": "auto_chunk_min_tokens",
}


def pic_arg_parser() -> argparse.ArgumentParser:
    d = PicConfig()
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sgl_pic")
    g.add_argument("--pic-policy", choices=POLICIES.names(), default=d.policy)
    g.add_argument("--pic-r", type=float, default=d.daric_r, help="DARIC initial ratio r")
    g.add_argument("--pic-n-avg", type=float, default=d.daric_n_avg, help="DARIC n_avg")
    g.add_argument("--pic-mtaf", choices=MTAF_NAMES, default=d.daric_mtaf, help="DARIC MTAF")
    g.add_argument("--pic-max-iters", type=int, default=d.daric_max_iters)
    g.add_argument("--pic-epic-k", type=int, default=d.epic_k)
    g.add_argument("--pic-cacheblend-ratio", type=float, default=d.cacheblend_ratio)
    g.add_argument("--pic-cachetune-r", type=float, default=d.cachetune_r)
    g.add_argument("--pic-alpha", type=float, default=d.cachetune_alpha, help="CacheTune alpha")
    g.add_argument("--pic-qa-ratio", type=float, default=d.qa_ratio, help="query_aware budget")
    g.add_argument("--pic-qa-min-tokens", type=int, default=d.qa_min_tokens)
    g.add_argument("--pic-qa-sink-tokens", type=int, default=d.qa_sink_tokens)
    g.add_argument("--pic-qa-layers", type=int, default=d.qa_layers, help="query_aware probe depth")
    g.add_argument("--pic-segment-tokens", type=int, default=d.segment_tokens)
    g.add_argument("--pic-delimiter", default=d.delimiter)
    g.add_argument(
        "--pic-max-chunks", type=int, default=d.max_chunks, help="most chunks per request"
    )
    g.add_argument(
        "--pic-min-chunk-tokens",
        type=int,
        default=d.min_chunk_tokens,
        help="fewest tokens per chunk",
    )
    g.add_argument(
        "--pic-auto-chunk-min-tokens",
        type=int,
        default=d.auto_chunk_min_tokens,
        help="fewest tokens of a message text auto-chunking makes a chunk",
    )
    g.add_argument(
        "--pic-device-cache-fraction",
        type=float,
        default=0.5,
        help="share of SGLang's KV pool that cached chunks may hold",
    )
    g.add_argument("--pic-host-cache-mb", type=int, default=2048, help="host tier, MiB (0: off)")
    g.add_argument(
        "--pic-disk-cache-dir",
        default=None,
        help=f"disk tier directory (default {_default_disk_dir()}; '' turns it off)",
    )
    g.add_argument("--pic-disk-cache-mb", type=int, default=8192, help="disk tier, MiB")
    g.add_argument(
        "--pic-eviction",
        choices=EVICTION_POLICIES,
        default="gdsf",
        help="eviction order of chunk nodes, host and disk tiers (gdsf: recency, hits, size)",
    )
    g.add_argument(
        "--pic-admission",
        choices=ADMISSION_MODES,
        default="adaptive",
        help="store a missed chunk on first sight (always), on second sight (second_sight), "
        "or on second sight while few first-seen chunks come back (adaptive)",
    )
    g.add_argument(
        "--pic-calibrate",
        action="store_true",
        help="pick CacheTune's r per tier at start-up (cost model + golden-section search)",
    )
    g.add_argument("--pic-feed-mode", choices=FEED_MODES, default="threaded")
    g.add_argument(
        "--pic-feed-timeout-s",
        type=float,
        default=30.0,
        help="longest wait for one layer of host/disk KV; past it the batch runs exactly",
    )
    g.add_argument(
        "--pic-merge-gap",
        type=int,
        default=0,
        help="merge phase-2 runs separated by at most this many tokens (they are recomputed)",
    )
    g.add_argument("--pic-max-body-mb", type=int, default=64, help="largest request body")
    g.add_argument("--pic-max-json-depth", type=int, default=64, help="deepest JSON nesting")
    g.add_argument(
        "--pic-shared-store",
        default="",
        metavar="URL",
        help="chunk tier shared by several servers, e.g. mooncake://HOST:PORT "
        "(started by scripts/shared_store.sh); '' (default): off",
    )
    g.add_argument(
        "--pic-public-namespaces",
        default="",
        metavar="NAMES",
        help="namespaces (a cache_salt or extra_key value, comma list) whose chunks any "
        "request asking for the public scope ('pic': {'config': {'public_scope': true}}) "
        "may read; '' (default): tenants share nothing",
    )
    g.add_argument(
        "--pic-namespace-device-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="share of the chunk nodes' pool slots one tenant (cache_salt/extra_key "
        "namespace) may hold; past it its chunks evict only its own (0, default: no cap)",
    )
    g.add_argument(
        "--pic-namespace-host-mb",
        type=int,
        default=0,
        metavar="MIB",
        help="host-tier MiB one tenant may hold (0, default: no cap)",
    )
    g.add_argument(
        "--pic-namespace-disk-mb",
        type=int,
        default=0,
        metavar="MIB",
        help="disk-tier MiB one tenant may hold (0, default: no cap)",
    )
    g.add_argument(
        "--pic-namespace-metrics",
        type=int,
        default=0,
        metavar="N",
        help="per-tenant metrics for at most N tenants (labelled by a digest prefix, the "
        "rest 'other'); 0 (default): off",
    )
    g.add_argument(
        "--pic-auto-chunk",
        default="",
        metavar="ROLES",
        help="chat messages /v1/chat/completions marks as chunks itself: a comma list of "
        f"{', '.join(AUTO_CHUNK_ROLES)} (tool results, messages named 'document', earlier "
        "turns of the other roles); '' (default): off",
    )
    g.add_argument(
        "--pic-check",
        action="store_true",
        help="run the correctness gate (python -m sgl_pic.check) on the model first; reuse is "
        "refused (exact prefill for every request) if it fails",
    )
    g.add_argument("--pic-check-out", default="", metavar="PATH", help="--pic-check's JSON")
    g.add_argument("--pic-disable", action="store_true", help="serve plain SGLang")
    return p


def _default_disk_dir() -> str:
    from sgl_pic.paths import cache_root

    return str(cache_root() / "chunks")


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build(argv: list[str]) -> tuple[list[str], argparse.Namespace, PicConfig]:
    """(SGLang argv, our namespace, PicConfig); SGLang's argv gets our defaults added."""
    ns, rest = pic_arg_parser().parse_known_args(argv)
    page = _flag_value(rest, "--page-size")
    config = PicConfig(
        **{field: getattr(ns, flag[2:].replace("-", "_")) for flag, field in PIC_FLAGS.items()},
        page_size=int(page) if page else 1,
    )
    if _flag_value(rest, "--model-path") is None and _flag_value(rest, "--model") is None:
        from sgl_pic.model.embedded import ensure_embedded_model

        rest = ["--model-path", str(ensure_embedded_model().path), *rest]
    if not ns.pic_disable:
        from sgl_pic.binding.settings import BACKEND_NAME

        if _flag_value(rest, "--radix-cache-backend") is None:
            rest += ["--radix-cache-backend", BACKEND_NAME]
        if "--enable-metrics" not in rest:
            rest.append("--enable-metrics")
    return rest, ns, config


def main(argv: list[str] | None = None) -> None:
    import torch

    from sgl_pic.binding.cpu_env import activate_cpu_stubs, with_cpu_defaults
    from sgl_pic.binding.settings import PicServerSettings

    sglang_argv, ns, config = build(list(sys.argv[1:] if argv is None else argv))
    on_cpu = _flag_value(sglang_argv, "--device") in (None, "cpu") and (
        _flag_value(sglang_argv, "--device") == "cpu" or not torch.cuda.is_available()
    )
    if on_cpu:
        activate_cpu_stubs()
        sglang_argv = with_cpu_defaults(sglang_argv)
    model_path = _flag_value(sglang_argv, "--model-path") or _flag_value(sglang_argv, "--model")
    assert model_path is not None

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins

    if not ns.pic_disable:
        from sgl_pic.binding.plugin import register

        register()
    load_plugins()
    server_args, sglang_argv = resolve_server_args(sglang_argv, reuse=not ns.pic_disable)
    if not ns.pic_disable:
        config = launch_check(server_args, config)
    refused = "" if ns.pic_disable or not ns.pic_check else _model_check(model_path, config, ns)
    settings = PicServerSettings(
        config,
        model_path=model_path,
        device_cache_fraction=ns.pic_device_cache_fraction,
        host_cache_mb=ns.pic_host_cache_mb,
        disk_cache_dir=_default_disk_dir()
        if ns.pic_disk_cache_dir is None
        else ns.pic_disk_cache_dir,
        disk_cache_mb=ns.pic_disk_cache_mb,
        eviction=ns.pic_eviction,
        admission=ns.pic_admission,
        calibrate=ns.pic_calibrate,
        feed_mode=ns.pic_feed_mode,
        feed_timeout_s=ns.pic_feed_timeout_s,
        merge_gap=ns.pic_merge_gap,
        max_body_mb=ns.pic_max_body_mb,
        max_json_depth=ns.pic_max_json_depth,
        shared_store=ns.pic_shared_store,
        public_namespaces=ns.pic_public_namespaces,
        namespace_device_fraction=ns.pic_namespace_device_fraction,
        namespace_host_mb=ns.pic_namespace_host_mb,
        namespace_disk_mb=ns.pic_namespace_disk_mb,
        namespace_metrics=ns.pic_namespace_metrics,
        auto_chunk=ns.pic_auto_chunk,
        refused=refused,
        secret=secrets.token_hex(32),
    )
    settings.to_env()
    if not ns.pic_disable:
        from sgl_pic.http import middleware as http_ext

        tokenizer = _flag_value(sglang_argv, "--tokenizer-path") or model_path
        from sgl_pic.http.chat_source import ServingFlags

        serving = ServingFlags(
            *(_flag_value(sglang_argv, "--" + f.replace("_", "-")) for f in ServingFlags._fields)
        )
        http_ext.install(settings, tokenizer, serving)
    run_server(server_args)


def resolve_server_args(argv: list[str], reuse: bool = True) -> tuple[Any, list[str]]:
    """SGLang's ``ServerArgs`` for ``argv``, resolved as its launcher resolves them, and
    the argv they came from. With ``reuse`` on and no attention backend named, a default
    the chunk path does not cover (SGLang picks trtllm_mha on Blackwell) is replaced by
    FlashInfer (triton where FlashInfer is missing), said in the log."""
    from sglang.srt.server_args import prepare_server_args

    from sgl_pic.binding.self_check import SUPPORTED_BACKENDS, attention_backends, resolved

    args = _resolved(prepare_server_args(argv))
    if not reuse or any(_flag_value(argv, flag) is not None for flag in BACKEND_FLAGS):
        return args, argv
    prefill, decode = attention_backends(resolved(args))
    if {prefill, decode} <= SUPPORTED_BACKENDS:
        return args, argv
    from sglang.srt.runtime_context import get_platform

    backend = "flashinfer" if get_platform().has_flashinfer else "triton"
    logger.warning(
        "sgl_pic: SGLang's default attention backend here (%s prefill, %s decode) is not "
        "covered by chunk reuse; serving with --attention-backend %s (name a backend to "
        "override)",
        prefill,
        decode,
        backend,
    )
    argv = [*argv, "--attention-backend", backend]
    return _resolved(prepare_server_args(argv)), argv


def _resolved(args: Any) -> Any:
    """``args`` resolved as SGLang's own ``run_server`` resolves them: its gRPC servers
    read the raw ``tokenizer_path``, which it seeds before resolution seals the record."""
    if (args.smg_grpc_mode or args.grpc_mode) and args.tokenizer_path is None:
        args.tokenizer_path = args.model_path
    args.resolve_once()
    return args


def launch_check(server_args: Any, config: PicConfig) -> PicConfig:
    """The launch-time self-check: ``config`` with the page size SGLang resolved (chunk
    starts are padded to it), and a log line saying whether the resolved arguments leave
    chunk reuse on, naming the flag that lifts a refusal. The scheduler makes the same
    decision on the same arguments (``model_hooks.check_support``) and acts on it."""
    from sgl_pic.binding.self_check import attention_backends, check_launch, resolved

    view = resolved(server_args)
    page = int(getattr(view, "page_size", None) or 1)
    if page != config.page_size:
        logger.info(
            "sgl_pic: SGLang resolved --page-size %d (asked: %d); chunk starts are padded to %d",
            page,
            config.page_size,
            page,
        )
    config = dataclasses.replace(config, page_size=page)
    support = check_launch(server_args, config.page_size)
    graphs = getattr(view, "cuda_graph_config", None)
    prefill_graph = getattr(getattr(graphs, "prefill", None), "backend", None)
    if support.ok:
        logger.info(
            "sgl_pic self-check: chunk reuse on (attention %s/%s, page size %d, prefill CUDA "
            "graphs %s: batches with chunked requests run eagerly)",
            *attention_backends(view),
            config.page_size,
            prefill_graph,
        )
    else:
        logger.warning(
            "sgl_pic self-check: chunk reuse will be off (%s): %s; every request runs as "
            "exact prefill",
            support.reason,
            support.detail,
        )
    return config


def _model_check(model_path: str, config: PicConfig, ns: argparse.Namespace) -> str:
    """Runs the correctness gate; '' when the model passed, else why reuse is refused."""
    from pathlib import Path

    from sgl_pic.cli.check import print_report, run_check, write_report

    # The precision floor takes no part in the verdict: not measured before serving.
    report = run_check(model_path, config, floor=False)
    print_report(report)
    if ns.pic_check_out:
        write_report(report, Path(ns.pic_check_out))
    return "" if report.passed else f"the model failed --pic-check: {report.failures}"


def _register_in_spawned_child() -> None:
    # SGLang spawns its scheduler; a spawned child imports this module as __mp_main__ before
    # anything else, which registers the backend and hooks there even where the entry point
    # is not installed (its load_plugins() then applies them).
    import os

    from sgl_pic.binding.settings import ENV_VAR

    if os.environ.get(ENV_VAR):
        from sgl_pic.binding.plugin import register

        register()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    _register_in_spawned_child()
