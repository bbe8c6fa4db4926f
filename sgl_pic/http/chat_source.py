"""Which chat template SGLang's chat path renders with, as the HTTP edge must render it.

SGLang picks it at launch (``TemplateManager.load_chat_template`` in
srt/parser/template_manager.py): ``--chat-template FILE.jinja`` replaces the tokenizer's
template with the file's text; a built-in conversation template (named, or guessed from the
model path), a Python chat encoder or a JSON template renders without the tokenizer's
Jinja template at all. The edge renders chunked chat requests with the tokenizer's Jinja
template (``chat_render``), so it takes the file's text where SGLang does and refuses chat
chunking where SGLang renders otherwise: reuse may approximate a prompt's KV, never
change the prompt.

Called on the HTTP server's side; the tokenizer is loaded on first use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class ServingFlags(NamedTuple):
    """The SGLang flags that decide how its chat path renders (None: not given)."""

    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    hf_chat_template_name: str | None = None


class ChatSource:
    """flags: the launch's ``ServingFlags`` (or a ``--chat-template`` value alone, None: not
    given). model_path: the served model's directory or name. load_tokenizer() returns its
    HF tokenizer."""

    def __init__(
        self,
        flags: ServingFlags | str | None,
        model_path: str,
        load_tokenizer: Callable[[], Any],
    ) -> None:
        if not isinstance(flags, ServingFlags):
            flags = ServingFlags(chat_template=flags)
        self.flags = flags
        self.chat_template_arg = flags.chat_template or None
        self.model_path = model_path
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._refusal: str | None = None

    def tokenizer(self) -> Any:
        """The tokenizer with the template SGLang renders with (the ``.jinja`` file's text,
        read as SGLang reads it, when one was given). Loaded once."""
        if self._tokenizer is None:
            tokenizer = self._load_tokenizer()
            jinja = self._jinja_text()
            if jinja is not None:
                tokenizer.chat_template = jinja
            self._tokenizer = tokenizer
        return self._tokenizer

    def refusal(self) -> str:
        """'' when SGLang renders chat requests with the tokenizer's Jinja template (as
        ``tokenizer()`` holds it); else why chunked chat requests cannot be rendered as it
        renders them here."""
        if self._refusal is None:
            try:
                self._refusal = (
                    self._launch_refusal() or self._model_refusal() or self._tokenizer_refusal()
                )
            except Exception as e:  # noqa: BLE001 - unknown means not provably SGLang's prompt
                logger.exception("sgl_pic: cannot tell how SGLang renders chat requests")
                self._refusal = f"how SGLang renders chat requests could not be read ({e!r})"
        return self._refusal

    def _jinja_text(self) -> str | None:
        arg = self.chat_template_arg
        if arg is None or not arg.endswith(".jinja") or not os.path.isfile(arg):
            return None
        # As SGLang's _load_jinja_template reads it.
        return Path(arg).read_text().strip("\n").replace("\\n", "\n")

    def _launch_refusal(self) -> str:
        from sglang.srt.parser.conversation import (
            chat_template_exists,
            get_conv_template_by_model_path,
        )
        from sglang.srt.parser.python_chat_template import get_python_chat_template

        arg = self.chat_template_arg
        if arg is None:
            name = get_conv_template_by_model_path(self.model_path)
            if name is not None:
                return f"SGLang renders this model with its conversation template {name!r}"
            return ""
        if chat_template_exists(arg):
            return f"--chat-template {arg!r} is one of SGLang's conversation templates"
        if get_python_chat_template(arg) is not None:
            return f"--chat-template {arg!r} is one of SGLang's Python chat encoders"
        if self._jinja_text() is None:
            return f"--chat-template {arg!r} is not a Jinja template file"
        return ""

    def _model_refusal(self) -> str:
        """SGLang's chat path renders some models with code of its own rather than the
        Jinja template (srt/entrypoints/openai/chat_encoding.py, python_chat_template.py,
        serving_chat.py's effort settings)."""
        from sglang.srt.entrypoints.openai.chat_encoding import resolve_chat_encoding_spec
        from sglang.srt.parser.hunyuan_reasoning import uses_hunyuan_reasoning_effort
        from sglang.srt.parser.python_chat_template import resolve_python_chat_template
        from sglang.srt.parser.template_detection import detect_reasoning_pattern
        from transformers import PretrainedConfig

        if self.flags.hf_chat_template_name:
            return "--hf-chat-template-name picks the template among the processor's"
        tokenizer = self.tokenizer()
        template = getattr(tokenizer, "chat_template", None)
        try:
            config, _ = PretrainedConfig.get_config_dict(self.model_path)
        except (OSError, ValueError):
            config = {}  # SGLang cannot load such a model either; the flags still count
        hf = SimpleNamespace(
            architectures=config.get("architectures") or [], model_type=config.get("model_type")
        )
        spec = resolve_chat_encoding_spec(
            hf_config=hf, tokenizer=tokenizer, tool_call_parser=self.flags.tool_call_parser
        )
        if spec is not None:
            return f"SGLang renders this model with its own chat encoder ({spec})"
        if not isinstance(template, str):
            return ""
        if self.chat_template_arg is None and resolve_python_chat_template(hf, template):
            return "SGLang renders this model with a Python chat encoder"
        _, reasoning = detect_reasoning_pattern(template)
        if reasoning is not None and reasoning.effort_kwarg is not None:
            return f"SGLang sets the template's {reasoning.effort_kwarg!r} from reasoning_effort"
        if uses_hunyuan_reasoning_effort(self.flags.reasoning_parser, reasoning):
            return "SGLang rewrites reasoning_effort for this model's template"
        return ""

    def _tokenizer_refusal(self) -> str:
        """Chunks are tokenized on their own: a tokenizer that adds text to a piece alone
        (a SentencePiece dummy prefix, "▁") would change the prompt's text."""
        tokenizer = self.tokenizer()
        pieces = ("The passage reads", " as follows.\n", "end of it", "\n\nQuestion:")
        ids = [t for p in pieces for t in tokenizer(p, add_special_tokens=False)["input_ids"]]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if text != "".join(pieces):
            return "this tokenizer changes the text of a piece tokenized on its own"
        return ""
