"""Small chunked prompts built from the embedded model's tokenizer."""

from __future__ import annotations

from functools import cache

DOCS = {
    "A": "Lyon sits where the Rhone meets the Saone; its old town is a UNESCO site.",
    "B": "Kyoto was Japan's capital for a thousand years and has many wooden temples.",
    "C": "Quito, the capital of Ecuador, lies almost exactly on the equator.",
    "D": "Tromso in Norway sees the midnight sun from May to July each year.",
    "E": "Valparaiso is a Chilean port famous for its funiculars and painted houses.",
}


@cache
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from sgl_pic.model.embedded import ensure_embedded_model

    return AutoTokenizer.from_pretrained(str(ensure_embedded_model().path))


def ids(text: str) -> list[int]:
    return list(tokenizer()(text, add_special_tokens=False)["input_ids"])


def chunked(names: list[str], question: str, header: str = "") -> tuple[list[int], list[list[int]]]:
    """Token ids and chunk spans: optional fresh header, the named docs, the question."""
    toks = ids(header) if header else []
    spans = []
    for name in names:
        t = ids(DOCS[name] + "\n")
        spans.append([len(toks), len(toks) + len(t)])
        toks += t
    toks += ids("Question: " + question + "\nAnswer:")
    return toks, spans


def body(toks: list[int], spans: list[list[int]] | None, n: int = 12, **pic: object) -> dict:
    out: dict = {"input_ids": toks, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
    if spans is not None:
        out["pic"] = {"chunks": spans, **({"config": pic} if pic else {})}
    return out
