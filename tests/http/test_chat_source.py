"""The chat template the HTTP edge renders with is the one SGLang's chat path uses, or chat
chunking is off: ``--chat-template FILE.jinja`` is read as SGLang reads it, and a template
SGLang renders without the tokenizer's Jinja text refuses chunk marks."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_pic.binding.cpu_env import activate_cpu_stubs
from sgl_pic.config import PicConfig
from sgl_pic.core.spans import MarkSigner
from sgl_pic.http.chat_source import ChatSource, ServingFlags
from sgl_pic.http.request_translator import RequestTranslator
from sgl_pic.layout import LayoutError

activate_cpu_stubs()  # SGLang's template registry imports torchvision, stubbed on the CPU


class FakeTokenizer:
    """Renders each message as ``<role>content``, one character per token."""

    def __init__(self) -> None:
        self.chat_template: str | None = None  # rendered by apply_chat_template alone

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], **_kw: object) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], **_kw: object) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


MSGS = [
    {"role": "user", "content": "a document long enough to be a chunk", "pic_chunk": True},
    {"role": "user", "content": "Q?"},
]


def test_a_jinja_file_replaces_the_tokenizers_template_as_sglang_reads_it(
    tmp_path: Path,
) -> None:
    f = tmp_path / "mine.jinja"
    f.write_text("\n{{ mine }}\\n\n")  # SGLang strips newlines and unescapes "\n"
    source = ChatSource(str(f), "/models/llama-like", FakeTokenizer)
    assert source.tokenizer().chat_template == "{{ mine }}\n"
    assert source.refusal() == ""


@pytest.mark.parametrize(
    ("arg", "model", "why"),
    [
        ("chatml", "/models/llama-like", "conversation templates"),
        ("/no/such/file.jinja", "/models/llama-like", "not a Jinja template file"),
        (None, "/models/vicuna-7b-v1.5", "conversation template 'vicuna_v1.1'"),
    ],
)
def test_templates_sglang_renders_otherwise_refuse_chat_chunking(
    arg: str | None, model: str, why: str
) -> None:
    assert why in ChatSource(arg, model, FakeTokenizer).refusal()


class DummyPrefixTokenizer(FakeTokenizer):
    """A SentencePiece-style tokenizer: a piece alone gains a leading space."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in " " + text.lstrip(" ")]}


def test_a_tokenizer_that_changes_a_piece_alone_refuses_chat_chunking() -> None:
    why = ChatSource(None, "/models/llama-like", DummyPrefixTokenizer).refusal()
    assert "changes the text of a piece" in why
    assert ChatSource(None, "/models/llama-like", FakeTokenizer).refusal() == ""


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (ServingFlags(tool_call_parser="deepseekv32"), "its own chat encoder (dsv32)"),
        (ServingFlags(hf_chat_template_name="tool_use"), "--hf-chat-template-name"),
    ],
)
def test_flags_that_make_sglang_render_otherwise_refuse_chat_chunking(
    flags: ServingFlags, why: str
) -> None:
    assert why in ChatSource(flags, "/models/llama-like", FakeTokenizer).refusal()


def test_the_models_own_template_is_served(embedded_path: str) -> None:
    from sgl_pic.http.middleware import hf_tokenizer

    assert ChatSource(None, embedded_path, lambda: hf_tokenizer(embedded_path)).refusal() == ""


def translator(refusal: str) -> RequestTranslator:
    return RequestTranslator(
        PicConfig(min_chunk_tokens=1),
        FakeTokenizer,
        MarkSigner("k"),
        auto_chunk=frozenset({"user"}),
        chat_refusal=lambda: refusal,
    )


def test_a_refused_template_gets_a_400_for_marks_and_no_auto_chunks() -> None:
    with pytest.raises(LayoutError, match="chunk marks in chat requests are off"):
        translator("SGLang renders this model with X").chat({"messages": [dict(m) for m in MSGS]})
    plain = [{k: v for k, v in m.items() if k != "pic_chunk"} for m in MSGS]
    assert translator("SGLang renders this model with X").chat({"messages": plain}) is None
    assert translator("").chat({"messages": [dict(m) for m in MSGS]}) is not None


def test_a_source_it_cannot_read_refuses_rather_than_guess() -> None:
    def broken() -> FakeTokenizer:
        raise OSError("no tokenizer here")

    assert "could not be read" in ChatSource(None, "/models/llama-like", broken).refusal()
