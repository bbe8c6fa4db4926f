"""A chunked request's planned prefill cost, estimated on the scheduler before its batch forms.

SGLang's prefill budget charges every extend token as computed. A chunked request computes
far fewer: the chunk path (``executor``) encodes the chunks found in no tier (phase 1), runs
the query probe or CacheBlend's deviation pass where its policy reads one, and recomputes
the policy's selection with the fresh text and the last token (phase 2); every other row's
KV is copied or loaded. ``PlannedCost.estimate`` counts those rows for one request as it
stands in the queue, so the scheduler can charge them (``binding.cost_adder``).

It is an estimate, made without running anything:
- where a chunk is held is asked of the chunk nodes and the host and disk tiers with
  ``contains`` only (no access is counted, nothing is locked); the shared tier is not asked
  (a network call): a chunk held only there counts as a miss. A chunk may be evicted or
  stored between this look and the batch's own lookup.
- a miss is assumed stored by phase 1 (store admission may compute it in context instead,
  which costs fewer rows: its length once, not phase 1 and a share of phase 2).
- the selection is the request's own policy (``planner.classify`` and ``planner.select``,
  calibrated r included) run over stand-in signals: registered policies choose a number
  of tokens that does not depend on the signal values, so the count is the one the batch
  recomputes. Where the device prefix cuts a chunk, which rows are chosen matters (rows in
  the prefix are dropped, rows recomputed anyway are counted once): the stand-ins put each
  chunk's last rows first and forced rows last, so the count is then an upper bound.
- a signal pass over ``l`` of the model's ``L`` layers counts its rows times ``l / L``;
  copying and re-rotating a reused row counts ``assembly_weight`` of a computed row.
Everything is counted in rows of a full forward and capped at the extend length: the
estimate only ever lowers what a request takes from the compute budget.

Scheduler side: called while SGLang forms a prefill batch, on the scheduler's thread.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from sgl_pic.config import PicConfig
from sgl_pic.core.gate import Pending
from sgl_pic.engine import planner
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.lower_tiers import LowerTiers
from sgl_pic.engine.planner import ChunkLookup, RequestPlan

# CacheBlend's deviation pass runs layers 0 and 1 (``deviation_probe.DeviationProbe``).
DEVIATION_LAYERS = 2


class Presence(Protocol):
    """Where a chunk is held now, without touching it: "device", "host", "disk" or None."""

    def tier(
        self, chunk_ids: tuple[int, ...], readable: Sequence[str], context: str = ""
    ) -> str | None: ...


class _Memo:
    """A bounded least-recently-used map: what an estimate computes of a request that
    stays the same while it waits (its chunks' key digests, its selection's size)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._items[key] = make()
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


class TierPresence:
    """``Presence`` over the chunk nodes and the host and disk tiers (``lower``: None when
    both are off), in the request's readable namespaces, own first. Reads ``contains``
    only: no access counts, no locks, no network. The segment key digests of the last
    ``memo_chunks`` chunks asked about are kept (a waiting request is asked about at every
    scheduling pass; hashing its chunks again each time would cost more than the look)."""

    def __init__(
        self, nodes: ChunkNodeTable, lower: LowerTiers | None = None, memo_chunks: int = 1024
    ) -> None:
        self.nodes = nodes
        self.lower = lower
        self._digests = _Memo(memo_chunks)

    def digests(
        self, table: str, chunk_ids: tuple[int, ...], namespace: str, context: str = ""
    ) -> tuple[str, ...]:
        """The segment key digests of a chunk in ``table`` ("nodes" or "lower": their
        fingerprints differ), encoded after ``context``."""
        keys = self.nodes.keys if table == "nodes" else self.lower.keys  # type: ignore[union-attr]
        # The weights' identity is part of the memo's key: a weight update re-keys the
        # tables (``ChunkNodeTable.rekey``), and a digest of the old weights finds nothing.
        weights = self.nodes.fingerprint.model_id
        return self._digests.get(
            (table, weights, namespace, context, chunk_ids),
            lambda: tuple(k.digest for k in keys(chunk_ids, namespace, context)),
        )

    def tier(
        self, chunk_ids: tuple[int, ...], readable: Sequence[str], context: str = ""
    ) -> str | None:
        nodes = self.nodes
        for ns in readable:
            if all(nodes.contains(d) for d in self.digests("nodes", chunk_ids, ns, context)):
                return "device"
        lower = self.lower
        if lower is None:
            return None
        host, disk = lower.store.host, lower.store.disk
        for ns in readable:
            digests = self.digests("lower", chunk_ids, ns, context)
            if all(host.contains(d) for d in digests):
                return "host"
            if all(host.contains(d) or disk.contains(d) for d in digests):
                return "disk"
        return None


class CostEstimate(NamedTuple):
    """One request's planned rows, from its device prefix on.

    extend:   rows SGLang counts (prompt tokens past the device prefix).
    encoded:  rows of chunks held in no tier, which phase 1 encodes (with their context
              where it computes that too).
    computed: rows phase 2 computes (selection, fresh text, forced rows, the last token).
    signals:  rows of signal passes, scaled by the layers they run.
    reused:   chunk rows past the device prefix found in a tier (copied or loaded).
    cost:     what the request takes from the compute budget: the sum of the above, each
              reused row at ``assembly_weight``, rounded up, at least 1, at most ``extend``."""

    extend: int
    encoded: int
    computed: int
    signals: float
    reused: int
    cost: int


class _StandInSignals:
    """``planner.Signals`` for the estimate: flat scores, but rows the plan recomputes
    anyway (forced) last, so the policy's choice overlaps them the least (the most rows a
    real signal can add); notes which passes the policy asked for."""

    def __init__(self) -> None:
        self.deviation_read = False
        self.query_read = False

    @staticmethod
    def scores(plan: RequestPlan) -> torch.Tensor:
        out = torch.zeros(plan.num_tokens)  # host: planning
        if plan.forced is not None and plan.forced.numel():
            out[plan.forced] = -1.0
        return out

    def deviation(self, plan: RequestPlan) -> torch.Tensor:
        self.deviation_read = True
        return self.scores(plan)

    def query_attention(self, plan: RequestPlan) -> torch.Tensor:
        self.query_read = True
        return self.scores(plan)


def _last_first(n: int) -> torch.Tensor:
    """# [n] a chunk's ranking for the estimate: its last rows first, so a chunk the device
    prefix cuts has its ranked rows past the prefix (the most a ranking can put there).
    Phase 1 ranks a stored miss when it stores it: it gets one too."""
    return torch.arange(n, dtype=torch.float32)  # host: planning


class PlannedCost:
    """presence:  where chunks are held (``TierPresence`` in a server).
    num_layers:   the model's decoder layers (signal passes run a part of them).
    ratios:       calibrated CacheTune r per tier, as the executor's selection uses them
                  (None: calibration off).
    assembly_weight: cost of copying or loading one reused row, in computed rows (0: not
                  counted; it is small next to a row's forward and not measured here).
    memo_plans:   selections kept, by request, prefix, config and where its chunks are
                  held: the count is the same while those are (the policy need not run
                  again at every pass the request waits)."""

    def __init__(
        self,
        presence: Presence,
        num_layers: int,
        ratios: dict[str, float] | None = None,
        assembly_weight: float = 0.0,
        memo_plans: int = 1024,
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if not 0.0 <= assembly_weight <= 1.0:
            raise ValueError(f"assembly_weight must be in [0, 1], got {assembly_weight}")
        self.presence = presence
        self.num_layers = num_layers
        self.ratios = ratios
        self.assembly_weight = assembly_weight
        self._plans = _Memo(memo_plans)

    def estimate(self, pending: Pending, config: PicConfig, prefix: int) -> CostEstimate:
        """The planned rows of ``pending`` (its verified marks) run under ``config`` (its
        effective config) with ``prefix`` tokens already in SGLang's prefix tree."""
        n = len(pending.token_ids)
        if not 0 <= prefix < n:
            raise ValueError(f"device prefix {prefix} outside [0, {n})")
        extend = n - prefix
        if config.exact:
            # Every row is recomputed: the chunk path saves nothing over SGLang's charge.
            return CostEstimate(extend, 0, extend, 0.0, 0, extend)
        spans = pending.request.layout.chunks
        tiers = tuple(
            self.presence.tier(
                pending.token_ids[c.start : c.end], pending.readable, pending.context_of(c.start)
            )
            if c.end > prefix
            else "prefix"
            for c in spans
        )
        # A miss is encoded whole, one the device prefix cuts included, with its context
        # where phase 1 computes that too (``phase1``).
        encoded = sum(
            c.length + pending.encoding.end * pending.context_computed(c.start, prefix)
            for c, t in zip(spans, tiers, strict=True)
            if t is None
        )
        # The marks by identity (kept alive in the entry, so the id is not reused): a
        # request keeps the same ``Pending`` while it waits.
        key = (id(pending), prefix, config, tiers)
        _marks, computed, reused, signals = self._plans.get(
            key, lambda: (pending, *self._selection(pending, config, prefix, tiers))
        )
        total = encoded + computed + signals + self.assembly_weight * reused
        cost = min(extend, max(1, math.ceil(total - 1e-9)))
        return CostEstimate(extend, encoded, computed, signals, reused, cost)

    def _selection(
        self, pending: Pending, config: PicConfig, prefix: int, tiers: tuple[str | None, ...]
    ) -> tuple[int, int, float]:
        """(rows phase 2 computes, reused rows, signal rows) of ``pending`` with its chunks
        held in ``tiers`` (one per chunk; "prefix" for one inside the device prefix)."""
        n = len(pending.token_ids)
        extend = n - prefix
        where = {
            (c.start, c.end): t for c, t in zip(pending.request.layout.chunks, tiers, strict=True)
        }
        plan = RequestPlan(0, 0, prefix, pending, config)

        def lookup(start: int, end: int) -> ChunkLookup:
            return ChunkLookup(where[(start, end)], _last_first(end - start))

        # A cut chunk, hit or encoded whole, as any other (phase 1 ranks a miss).
        planner.classify(plan, lookup, lambda start, end, keep: lookup(start, end))
        flat = _StandInSignals()
        selected = planner.select(plan, flat, self.ratios)
        assert plan.forced is not None
        reused = sum(end - start for start, end in plan.hit_spans)
        signals = 0.0
        if flat.deviation_read:
            signals += extend * min(DEVIATION_LAYERS, self.num_layers) / self.num_layers
        if flat.query_read:
            # The probe runs the rows phase 2 computes whatever the policy says.
            fresh = torch.tensor(plan.layout.fresh_indices() + [n - 1])  # host: planning
            must = torch.unique(torch.cat([plan.forced, fresh]).to(torch.int64))
            rows = int((must >= prefix).sum())
            layers = min(plan.config.qa_layers, self.num_layers)
            signals += rows * layers / self.num_layers
        return int(selected.numel()), reused, signals
