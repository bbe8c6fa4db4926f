"""The drift signal in OpenAI chat responses: ``metadata["pic_first_token_entropy"]``.

A native ``/generate`` response served by reuse carries its first-token entropy in
``meta_info`` (``binding/drift_signal``). SGLang's chat responses drop ``meta_info``
unless the request asks for all of it (``return_meta_info``), and their ``usage`` and
``sglext`` models have fixed fields; a chat response that is not streamed does have a
free-form ``metadata`` dict (SGLang puts the weight version there). After SGLang builds
one, ``after_build_response`` adds the entropy there: one value per choice, in the order
of ``choices``, None for a choice not served by reuse. A response none of whose choices
was served by reuse is left as SGLang built it, so a server without reuse answers byte
for byte as before. Streamed chunks have no such field and are not changed;
``/v1/completions`` takes no chunk marks, so it is never served by reuse.

HTTP side: SGLang's HookRegistry calls the hook (AFTER ``CHAT_TARGET``, registered by
``plugin.register``) in the process that serves its HTTP app; it reads the results SGLang
passed to the builder and changes only the response it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sgl_pic.core.drift_signal import META_KEY

logger = logging.getLogger(__name__)

CHAT_TARGET = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._build_chat_response"


def choice_entropies(ret: Sequence[Mapping[str, Any]]) -> list[float | None] | None:
    """Each result's first-token entropy (its ``meta_info`` list's first value that is
    not None), in order; None where no result has one."""
    values: list[float | None] = []
    for item in ret:
        meta = item.get("meta_info") or {}
        column = meta.get(META_KEY) or ()
        values.append(next((float(v) for v in column if v is not None), None))
    return values if any(v is not None for v in values) else None


def after_build_response(result: Any, serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``_build_chat_response(request, ret, created)`` (``serving``: SGLang's chat
    serving object; ``ret``: one result per choice, by position or by name). Returns the
    response with the entropies in its ``metadata``; an error response (no ``metadata``
    field) or one without entropies comes back unchanged. Whatever goes wrong here is
    logged and the response returned as SGLang built it: the signal is never worth a
    failed request."""
    if not hasattr(result, "metadata"):
        return result
    try:
        ret = kwargs["ret"] if "ret" in kwargs else args[1]
        values = choice_entropies(ret)
        if values is not None:
            result.metadata = {**(result.metadata or {}), META_KEY: values}
    except Exception:
        logger.exception("sgl_pic: the drift signal was not added to a chat response")
    return result
