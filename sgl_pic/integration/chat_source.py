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

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class ChatSource:
    """chat_template_arg: SGLang's ``--chat-template`` (None: not given). model_path: the
    served model's directory or name. load_tokenizer() returns its HF tokenizer."""

    def __init__(
        self, chat_template_arg: str | None, model_path: str, load_tokenizer: Callable[[], Any]
    ) -> None:
        self.chat_template_arg = chat_template_arg or None
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
            self._refusal = self._launch_refusal() or self._python_template_refusal()
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

    def _python_template_refusal(self) -> str:
        from sglang.srt.parser.python_chat_template import resolve_python_chat_template

        template = getattr(self.tokenizer(), "chat_template", None)
        if not isinstance(template, str) or self.chat_template_arg is not None:
            return ""
        from transformers import PretrainedConfig

        config, _ = PretrainedConfig.get_config_dict(self.model_path)
        hf = SimpleNamespace(architectures=config.get("architectures") or [])
        if resolve_python_chat_template(hf, template) is not None:
            return "SGLang renders this model with a Python chat encoder"
        return ""
