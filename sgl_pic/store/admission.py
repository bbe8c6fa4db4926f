"""Whether a chunk found in no tier is stored the first time it is seen.

Storing a missed chunk costs more than computing it: its tokens run once on their own
(phase 1, for the position-independent KV the tiers keep) and the selected ones run again
in context (phase 2), where a chunk computed in context alone runs each token once. The
extra work pays off only if the chunk comes back. In a RAG stream with a churn of novel
documents most first sights never do (LMCache #4663: reuse decays to ~1x as novel chunks
flood the cache); in agent sessions nearly every first sight does (history turns and memory
are sent again next turn).

TinyLFU's doorkeeper (Einziger et al., 2017) admits an item on its second sight. Used
always, it would make every agent turn pay a full extra encode for what comes back anyway,
so the ``adaptive`` mode measures the stream instead: over a bounded window of recently
first-seen chunks, the share that was seen again (``reuse_rate``). While that share is at
least ``min_reuse`` (or fewer than ``warmup`` first sights have been seen) a first sight is
stored; below it, only second sights are. A deferred chunk is computed in context like
fresh text: every token of it computed in context, as plain prefill would, and nothing
evicted for it.

Decisions depend only on the sequence of lookups and on whether a tier held each chunk,
so tensor-parallel ranks, which see the same batches and store the same chunks, decide
alike; a failure local to one rank (a bad record on its disk) can set their windows apart,
as it already sets that batch's work apart. Chunks inside SGLang's device prefix are not
looked up, so they are not counted: the rate is that of the comebacks a stored chunk would
serve. Keys are the chunk's token tuple hash: a collision can only change an admission
decision, never which KV is reused (the tiers key by strong hashes).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

ADMISSION_MODES: tuple[str, ...] = ("always", "second_sight", "adaptive")


class AdmissionState(NamedTuple):
    """What ``StoreAdmission.restore`` puts back (``StoreAdmission.snapshot``)."""

    seen: OrderedDict[int, bool]
    seen_again: int
    deferred: int


class AdmissionStats(NamedTuple):
    first_sights: int  # first sights in the window
    seen_again: int  # of those, chunks looked up again since
    deferred: int  # misses not stored, since start
    reuse_rate: float  # seen_again / first_sights (1.0 before any)


class StoreAdmission:
    """mode:      "always" (store every miss), "second_sight" (TinyLFU's doorkeeper), or
                  "adaptive" (the doorkeeper while few first sights come back).
    min_reuse:    adaptive: the doorkeeper is on while ``reuse_rate`` is below this.
    warmup:       adaptive: first sights in the window before the rate is trusted.
    window:       first sights remembered, oldest forgotten first (in order of first sight,
                  not of last use: a chunk in steady use leaves the window like any other,
                  and comes back in as seen again at its next lookup, being stored)."""

    def __init__(
        self, mode: str = "adaptive", min_reuse: float = 0.5, warmup: int = 64, window: int = 1024
    ) -> None:
        check_mode(mode)
        if not 0.0 <= min_reuse <= 1.0:
            raise ValueError(f"min_reuse must be in [0, 1], got {min_reuse}")
        if warmup < 0 or window < 1:
            raise ValueError(f"warmup must be >= 0 and window >= 1, got {warmup}, {window}")
        if mode == "adaptive" and warmup >= window:
            # The window never holds more than ``window`` first sights: the rate would
            # never be consulted, and adaptive would silently be "always".
            raise ValueError(f"warmup ({warmup}) must be below window ({window})")
        self.mode = mode
        self.min_reuse = min_reuse
        self.warmup = warmup
        self.window = window
        self._seen: OrderedDict[int, bool] = OrderedDict()  # key -> seen again since
        self._seen_again = 0
        self._deferred = 0

    def lookup(self, key: int, stored: bool) -> bool:
        """Records one lookup of chunk ``key`` (``stored``: some tier held it) and returns
        whether a miss is to be stored; a stored chunk returns True. Call once per chunk
        lookup, in prompt order."""
        again = self._seen.get(key)
        if again is None:
            # A stored chunk never seen here (a restart's disk tier, another server's
            # shared store, or forgotten by the window) has been seen before by definition.
            self._remember(key, stored)
            if stored or self._store_first_sight():
                return True
            self._deferred += 1
            return False
        if not again:
            self._seen[key] = True
            self._seen_again += 1
        return True

    @property
    def reuse_rate(self) -> float:
        return self._seen_again / len(self._seen) if self._seen else 1.0

    def snapshot(self) -> AdmissionState:
        """The state now, for ``restore``: a batch that falls back to plain prefill takes
        back the lookups it recorded, so that a chunk it stored nothing for is not taken as
        seen twice at its next lookup (``BatchAdmission.abandon``)."""
        return AdmissionState(OrderedDict(self._seen), self._seen_again, self._deferred)

    def restore(self, state: AdmissionState) -> None:
        self._seen = OrderedDict(state.seen)
        self._seen_again, self._deferred = state.seen_again, state.deferred

    def stats(self) -> AdmissionStats:
        return AdmissionStats(len(self._seen), self._seen_again, self._deferred, self.reuse_rate)

    def _store_first_sight(self) -> bool:
        if self.mode == "always":
            return True
        if self.mode == "second_sight":
            return False
        return len(self._seen) <= self.warmup or self.reuse_rate >= self.min_reuse

    def _remember(self, key: int, again: bool) -> None:
        self._seen[key] = again
        self._seen_again += again
        while len(self._seen) > self.window:
            _, old = self._seen.popitem(last=False)
            self._seen_again -= old


class BatchAdmission:
    """One batch's lookups in ``admission`` (None: every miss is stored), counted once
    however many attempts the batch takes. ``retry`` makes the next attempt replay this
    attempt's decisions, per chunk in lookup order, without counting them again (its
    lookups are of the same chunks); ``abandon`` takes back all the batch recorded, for a
    batch rerun as plain prefill, which looks nothing up."""

    def __init__(self, admission: StoreAdmission | None) -> None:
        self._admission = admission
        self._before = admission.snapshot() if admission is not None else None
        self._recorded: dict[int, list[bool]] = {}  # key -> this attempt's decisions
        self._replay: dict[int, list[bool]] = {}  # key -> the last attempt's, left to replay

    def lookup(self, key: int, stored: bool) -> bool:
        """``StoreAdmission.lookup`` for this attempt."""
        if self._admission is None:
            return True
        replay = self._replay.get(key)
        if replay:
            return replay.pop(0)
        admit = self._admission.lookup(key, stored)
        self._recorded.setdefault(key, []).append(admit)
        return admit

    def retry(self) -> None:
        self._replay, self._recorded = self._recorded, {}

    def abandon(self) -> None:
        if self._admission is not None and self._before is not None:
            self._admission.restore(self._before)


def check_mode(mode: str) -> None:
    if mode not in ADMISSION_MODES:
        raise ValueError(f"unknown admission mode {mode!r}; valid: {', '.join(ADMISSION_MODES)}")
