"""What the plain-torch oracle says a prompt's first output token should be, for tests
that compare a server's answer with it."""

from __future__ import annotations

import torch


def full_reuse_reference(
    toks: list[int], spans: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's next-token log-probabilities (# [vocab] float64 each) for full reuse of
    the prompt (each chunk's independent KV at its place, the fresh text computed over it)
    and for its exact prefill."""
    from sgl_pic.config import PicConfig
    from sgl_pic.layout import PromptLayout
    from sgl_pic.model.embedded import ensure_embedded_model
    from sgl_pic.oracle import Oracle
    from sgl_pic.selection import make_policy

    oracle = Oracle.from_pretrained(ensure_embedded_model().path)
    t = torch.tensor(toks)
    layout = PromptLayout.from_spans(len(toks), spans)
    chunks = [oracle.encode_chunk(t[s:e]) for s, e in spans]
    policy = make_policy(PicConfig(policy="full_reuse"))
    ref = torch.log_softmax(oracle.reuse(t, layout, chunks, policy).logits.double(), -1)
    full = torch.log_softmax(oracle.prefill(t).logits.double(), -1)
    return ref, full
