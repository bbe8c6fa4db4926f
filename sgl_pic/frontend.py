"""``chunk()`` for SGLang frontend programs (``sgl.function``).

    @sgl.function
    def qa(s, docs, question):
        s += "Answer from the documents.\\n"
        for d in docs:
            s += chunk(d)
        s += "Question: " + question + "\\nAnswer:" + sgl.gen("answer", max_tokens=16)

``chunk(text)`` records a chunk span in the program's prompt by enclosing ``text`` in the
server's chunk delimiter; the runtime endpoint sends the prompt to ``/generate`` as text,
where sgl_pic's server tokenizes each piece on its own (token-exact chunk boundaries) and
reuses the chunk's cached KV. Use it only against ``python -m sgl_pic.launch_server``: a
plain SGLang server would read the delimiters as ordinary text.
"""

from __future__ import annotations

from sgl_pic.config import PicConfig

DEFAULT_DELIMITER = PicConfig().delimiter


def chunk(text: str, delimiter: str = DEFAULT_DELIMITER) -> str:
    """``text`` marked as one reusable chunk (pass the server's ``--pic-delimiter`` if it
    is not the default)."""
    if not text:
        raise ValueError("a chunk needs non-empty text")
    if delimiter in text:
        raise ValueError(f"chunk text must not contain the delimiter {delimiter!r}")
    return f"{delimiter}{text}{delimiter}"
