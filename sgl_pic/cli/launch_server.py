"""``python -m sgl_pic.launch_server``: SGLang's server with position-independent chunk reuse.

Takes every SGLang server argument plus the ``--pic-*`` ones (``sgl_pic.cli.flags``, made
from the declared settings). With no model named it serves the embedded SmolLM2-135M; with
no GPU it adds SGLang's CPU flags (each only if not given). ``--pic-disable`` serves plain
SGLang through the same launcher (the baseline).

SGLang's arguments are resolved before anything starts: chunk starts are padded to the
page size SGLang resolved, and a self-check logs whether the resolved arguments leave the
chunk path on (each refusal names the flag that lifts it). SGLang's GPU defaults are kept,
prefill CUDA graphs included (batches with chunked requests run eagerly); only where no
attention backend was named, SGLang's default is one the chunk path does not cover
(trtllm_mha on Blackwell) and the model's config is one it covers
(``self_check.check_model_config``) is FlashInfer chosen instead, with a log line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import secrets
import sys
from typing import TYPE_CHECKING, Any

from sgl_pic.cli.flags import config_kwargs, pic_arg_parser, server_kwargs
from sgl_pic.config import PicConfig

if TYPE_CHECKING:
    from sgl_pic.binding.self_check import Support

logger = logging.getLogger(__name__)

BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build(argv: list[str]) -> tuple[list[str], argparse.Namespace, PicConfig]:
    """(SGLang argv, our namespace, PicConfig); SGLang's argv gets our defaults added."""
    parser = pic_arg_parser()
    ns, rest = parser.parse_known_args(argv)
    page = _flag_value(rest, "--page-size")
    try:
        config = PicConfig(**config_kwargs(ns), page_size=int(page) if page else 1)
    except ValueError as e:  # settings that do not go together
        parser.error(str(e))
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
        **server_kwargs(ns),
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
    FlashInfer (triton where FlashInfer is missing), said in the log, unless the model's
    config is one the chunk path refuses anyway (``_model_support``): SGLang's choice is
    kept for it (some models, GPT-OSS among them, accept only SGLang's backends)."""
    from sglang.srt.server_args import prepare_server_args

    from sgl_pic.binding.self_check import SUPPORTED_BACKENDS, attention_backends, resolved

    args = _resolved(prepare_server_args(argv))
    if not reuse or any(_flag_value(argv, flag) is not None for flag in BACKEND_FLAGS):
        return args, argv
    prefill, decode = attention_backends(resolved(args))
    if {prefill, decode} <= SUPPORTED_BACKENDS:
        return args, argv
    model = _model_support(args)
    if model is not None and not model.ok:
        logger.warning(
            "sgl_pic: keeping SGLang's attention backend (%s prefill, %s decode): chunk "
            "reuse will be off for this model (%s): %s",
            prefill,
            decode,
            model.reason,
            model.detail,
        )
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


def _model_support(args: Any) -> Support | None:
    """``self_check.check_model_config`` on SGLang's ``ModelConfig`` of the resolved
    ``args``, built as its scheduler builds it (``ModelConfig.from_server_args``); None,
    with why in the log, where the config cannot be read (the model is then checked as it
    loads)."""
    from sgl_pic.binding.self_check import check_model_config

    try:
        from sglang.srt.configs.model_config import ModelConfig

        return check_model_config(ModelConfig.from_server_args(args))
    except Exception as e:  # any failure to read the config: decided as the model loads
        logger.warning(
            "sgl_pic: could not read the model's config before it loads (%s: %s); it is "
            "checked as it loads",
            type(e).__name__,
            e,
        )
        return None


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
    chunk reuse on, naming the flag that lifts a refusal; where the backend is the refusal
    and the model's config is refused anyway, the model's refusal is named instead (no
    flag lifts it). The scheduler makes the same decision on the same arguments
    (``model_hooks.check_support``) and acts on it."""
    from sglang.srt.server_args import ServerArgs

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
    try:
        config = dataclasses.replace(config, page_size=page)
    except ValueError as e:  # a setting that needs another page size
        raise SystemExit(f"sgl_pic: {e} (SGLang resolved --page-size {page})") from e
    support = check_launch(server_args, config.page_size)
    if support.reason == "backend" and isinstance(server_args, ServerArgs):
        # SGLang's backend kept for a model refused anyway: name the model, not a flag.
        model = _model_support(server_args)
        support = model if model is not None and not model.ok else support
    graphs = getattr(view, "cuda_graph_config", None)
    prefill_graph = getattr(getattr(graphs, "prefill", None), "backend", None)
    if support.ok:
        logger.info(
            "sgl_pic self-check: the server arguments leave chunk reuse on (attention %s/%s, "
            "page size %d, prefill CUDA graphs %s: batches with chunked requests run "
            "eagerly); the model is checked as it loads ('sgl_pic chunk cache ready' or "
            "'chunk reuse is off' follows)",
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
    try:
        report = run_check(model_path, config, floor=False)
    except Exception as e:  # a model the gate cannot load: refused, never a dead launch
        logger.exception("sgl_pic: --pic-check could not run on %s", model_path)
        return f"--pic-check could not run on the model ({type(e).__name__}: {e})"
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
