"""Independent chunk KV, keyed by chained segment hashes (DARIC 3.3.2).

A chunk is stored as the segments ``sgl_pic.keys.segment_keys`` cuts it into; segment i's
key chains over segments 0..i, so a chunk hits only when every one of its segments is held.
Keys are post-RoPE at positions 0..n-1 of the chunk (SGLang's pool stores keys after RoPE);
the executor re-rotates them to where the chunk lands.

Memory: a byte budget with least-recently-used eviction. Entries are copied into the
request's KV slots before the forward that reads them, so no entry is in use while it
could be evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from sgl_pic.keys import ModelFingerprint, SegmentKey, segment_keys


class ChunkKV(NamedTuple):
    """kv: # [num_layers, 2, n, num_kv_heads, head_dim] (K post-RoPE at 0..n-1, then V).
    ranking: # [n] CacheTune ranking, or None."""

    kv: torch.Tensor
    ranking: torch.Tensor | None


class _Segment(NamedTuple):
    kv: torch.Tensor  # [num_layers, 2, seg_len, num_kv_heads, head_dim]
    ranking: torch.Tensor | None  # [seg_len]


class ChunkKVStore:
    def __init__(
        self, fingerprint: ModelFingerprint, segment_tokens: int, budget_bytes: int
    ) -> None:
        self.fingerprint = fingerprint
        self.segment_tokens = segment_tokens
        self.budget_bytes = budget_bytes
        self._segments: OrderedDict[str, _Segment] = OrderedDict()
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._segments)

    def keys(self, token_ids: Sequence[int]) -> tuple[SegmentKey, ...]:
        return segment_keys(list(token_ids), self.fingerprint, self.segment_tokens)

    def get(self, token_ids: Sequence[int]) -> ChunkKV | None:
        """The chunk's KV if every segment is held (and marks them recently used)."""
        keys = self.keys(token_ids)
        if any(k.digest not in self._segments for k in keys):
            return None
        segs = []
        for k in keys:
            self._segments.move_to_end(k.digest)
            segs.append(self._segments[k.digest])
        kv = torch.cat([s.kv for s in segs], dim=2)
        rankings = [s.ranking for s in segs]
        ranking = None if any(r is None for r in rankings) else torch.cat(rankings)
        return ChunkKV(kv, ranking)

    def put(
        self,
        token_ids: Sequence[int],
        kv: torch.Tensor,  # [num_layers, 2, n, num_kv_heads, head_dim]
        ranking: torch.Tensor | None = None,  # [n]
    ) -> None:
        n = len(token_ids)
        if kv.shape[2] != n:
            raise ValueError(f"KV holds {kv.shape[2]} tokens for a chunk of {n}")
        for k in self.keys(token_ids):
            if k.digest in self._segments:
                self._segments.move_to_end(k.digest)
                continue
            seg = _Segment(
                kv[:, :, k.start : k.end].clone(),
                None if ranking is None else ranking[k.start : k.end].clone(),
            )
            self._segments[k.digest] = seg
            self._bytes += _nbytes(seg)
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes and self._segments:
            _, seg = self._segments.popitem(last=False)
            self._bytes -= _nbytes(seg)


def _nbytes(seg: _Segment) -> int:
    n = seg.kv.numel() * seg.kv.element_size()
    if seg.ranking is not None:
        n += seg.ranking.numel() * seg.ranking.element_size()
    return n
