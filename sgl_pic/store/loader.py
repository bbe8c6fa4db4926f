"""Sparse loading with deferred RoPE (CacheTune 4.2, B.2, B.3).

For each reused chunk only the complement of its recomputed set is moved, one layer at
a time: (1 - r) N tokens' KV per layer instead of N. Keys are stored before RoPE; the
recompute path rotates them to their global positions in the assembled prompt
(chunk offset + local index), so the same record serves any offset.

Two steps per layer, so a pipeline can run them on different paths:
``fetch_layer`` (transfer path: gather rows out of the store) and ``rotate``
(recompute path: deferred RoPE); ``scatter`` writes the result into the request's own
working buffers. All three produce or write request-owned tensors; stored records are
never modified.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_pic.rope import RopeLayout, apply_rope
from sgl_pic.store.base import ChunkStore, check_key, normalize_indices


def complement(
    indices: torch.Tensor | Sequence[int],  # [k] int, local token indices
    num_tokens: int,
) -> torch.Tensor:
    """# [num_tokens - k'] int64: the sorted tokens of [0, num_tokens) not in
    ``indices`` (k' = unique count)."""
    keep = torch.ones(num_tokens, dtype=torch.bool, device="cpu")  # as normalize_indices
    keep[normalize_indices(indices, num_tokens)] = False
    return keep.nonzero().flatten()


@dataclass(frozen=True, eq=False)
class ChunkPlacement:
    """One reused chunk of a request.

    key:        the segment key in the store.
    num_tokens: the chunk's length N.
    offset:     global position of its first token in the assembled prompt.
    recompute:  # [k] int64 sorted local indices recomputed (never loaded).
    token_ids:  the chunk's tokens; when given, a record with other tokens is a miss.
    """

    key: str
    num_tokens: int
    offset: int
    recompute: torch.Tensor
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_key(self.key)
        if self.num_tokens < 1 or self.offset < 0:
            raise ValueError(f"bad placement: {self.num_tokens} tokens at {self.offset}")
        object.__setattr__(self, "recompute", normalize_indices(self.recompute, self.num_tokens))

    @property
    def reuse(self) -> torch.Tensor:
        """# [N - k] int64 local indices loaded from the store."""
        return complement(self.recompute, self.num_tokens)


@dataclass(frozen=True)
class LoaderConfig:
    """rope_layout: "neox" or "interleaved", as the model applies RoPE.
    device:         where fetched KV goes ("cpu" here; "cuda" in the engine).
    """

    rope_layout: str = "neox"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.rope_layout not in ("neox", "interleaved"):
            raise ValueError(f"unknown RoPE layout {self.rope_layout!r}; valid: neox, interleaved")
        torch.device(self.device)  # raises on a malformed device string


@dataclass(frozen=True, eq=False)
class FetchedLayer:
    """Reused KV of one layer for all chunks, still before RoPE (transfer path output).

    positions: # [n] int64 global positions, chunk by chunk.
    k, v:      # [n, num_kv_heads, head_dim]; k before RoPE.
    missing:   keys that were not in the store: the caller recomputes those chunks.
    """

    layer: int
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bytes_moved: int
    missing: tuple[str, ...]
    bytes_dense: int = 0  # what moving every token of the hit chunks would have cost


@dataclass(frozen=True, eq=False)
class LoadedLayer:
    """Reused KV of one layer, keys rotated to their global positions.

    positions: # [n] int64;  k, v: # [n, num_kv_heads, head_dim].
    """

    layer: int
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bytes_moved: int
    missing: tuple[str, ...]
    bytes_dense: int = 0  # what moving every token of the hit chunks would have cost


@dataclass(frozen=True)
class LoadStats:
    """layers_fetched: (chunk, layer) fetches that hit.
    tokens_moved:      token rows moved (per layer, summed).
    bytes_moved:       K and V bytes moved out of the store.
    bytes_dense:       what loading every token of those chunks would have moved.
    misses:            (chunk, layer) fetches that missed.
    """

    layers_fetched: int = 0
    tokens_moved: int = 0
    bytes_moved: int = 0
    bytes_dense: int = 0
    misses: int = 0


class SparseLoader:
    """Moves the reuse complement of each chunk out of ``store``, layer by layer.

    inv_freq: # [head_dim // 2] RoPE frequencies of the model.
    Lock the chunks in the store for the request (``store.locked``): an entry evicted
    between two layers shows up as ``missing``.
    """

    def __init__(self, store: ChunkStore, inv_freq: torch.Tensor, config: LoaderConfig) -> None:
        self.store = store
        self.inv_freq = inv_freq
        self.config = config
        self._device = torch.device(config.device)
        self._lock = threading.Lock()
        self._stats = LoadStats()

    def fetch_layer(self, chunks: Sequence[ChunkPlacement], layer: int) -> FetchedLayer:
        """Transfer path: the layer's reused rows of every chunk, pre-RoPE."""
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        pos: list[torch.Tensor] = []
        missing: list[str] = []
        moved = dense = tokens = 0
        skipped = 0  # tokens of chunks recomputed whole: nothing to move
        row = 0
        for c in chunks:
            reuse = c.reuse
            if reuse.numel() == 0:
                skipped += c.num_tokens
                continue
            part = self.store.get_layers(c.key, range(layer, layer + 1), reuse, c.token_ids)
            if part is None:
                missing.append(c.key)
                continue
            # Gather happened in the store; the device copy is where the ops gather
            # kernel (pinned staging + non_blocking H2D on the transfer stream) slots in.
            ks.append(part.k[0].to(self._device, non_blocking=True))
            vs.append(part.v[0].to(self._device, non_blocking=True))
            pos.append(part.token_indices + c.offset)
            moved += part.bytes_read
            row = part.k.shape[-2] * part.k.shape[-1] * part.k.element_size()
            dense += 2 * c.num_tokens * row
            tokens += part.token_indices.numel()
        # A chunk recomputed whole would have cost its full rows in a dense load; the row
        # size is known once any record was read in this layer (all share the model's).
        dense += 2 * skipped * row
        with self._lock:
            s = self._stats
            self._stats = LoadStats(
                s.layers_fetched + len(ks),
                s.tokens_moved + tokens,
                s.bytes_moved + moved,
                s.bytes_dense + dense,
                s.misses + len(missing),
            )
        if ks:
            k, v = torch.cat(ks), torch.cat(vs)
            positions = torch.cat(pos)
        else:
            k = v = torch.empty(0, device=self._device)
            # Positions stay on the host, like the non-empty ones (record token indices).
            positions = torch.empty(0, dtype=torch.int64, device="cpu")
        return FetchedLayer(layer, positions, k, v, moved, tuple(missing), dense)

    def rotate(self, fetched: FetchedLayer) -> LoadedLayer:
        """Recompute path: deferred RoPE, keys rotated to their global positions (a new
        tensor; the ops RoPE kernel slots in here)."""
        k = fetched.k
        if fetched.positions.numel():
            layout: RopeLayout = self.config.rope_layout  # type: ignore[assignment]
            k = apply_rope(
                fetched.k,
                fetched.positions.to(fetched.k.device),
                self.inv_freq.to(fetched.k.device),
                layout,
            )
        return LoadedLayer(
            fetched.layer,
            fetched.positions,
            k,
            fetched.v,
            fetched.bytes_moved,
            fetched.missing,
            fetched.bytes_dense,
        )

    def load_layer(self, chunks: Sequence[ChunkPlacement], layer: int) -> LoadedLayer:
        """``rotate(fetch_layer(...))`` in one call (the in-order path)."""
        return self.rotate(self.fetch_layer(chunks, layer))

    @staticmethod
    def scatter(
        loaded: LoadedLayer,
        k_buf: torch.Tensor,  # [num_prompt_tokens, num_kv_heads, head_dim], request-owned
        v_buf: torch.Tensor,  # [num_prompt_tokens, num_kv_heads, head_dim], request-owned
    ) -> None:
        """Write the reused rows into the request's working buffers at their global
        positions; the recompute path scatters its own rows into the rest (the ops
        scatter kernel slots in here)."""
        if loaded.positions.numel():
            idx = loaded.positions.to(k_buf.device)
            k_buf.index_copy_(0, idx, loaded.k.to(k_buf.dtype))
            v_buf.index_copy_(0, idx, loaded.v.to(v_buf.dtype))

    def stats(self) -> LoadStats:
        with self._lock:
            return self._stats
