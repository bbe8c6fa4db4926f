"""The scheduler-side gate every generate request passes before SGLang queues it.

It runs inside SGLang's scheduler (a hook around ``validate_input_length``), so it holds
for every HTTP path and for clients that bypass our middleware:

- token ids outside the vocabulary refuse the request with an error naming the index, and
  so does a count of top logprobs outside [0, vocabulary] (SGLang 0.5.23 would crash the
  scheduler on either);
- chunk marks are honoured only when their MAC checks out against the request's tokens
  (``MarkSigner``) and they pass the server's limits; otherwise they are stripped, counted,
  logged once, and the request runs as exact prefill;
- the request's prefix-tree namespace is set here from the verified config: exact requests
  (full_recompute, r = 1) share ``sgl_pic:exact``, approximate ones share KV only with
  requests making the same approximation (policy and budget). A namespace of ours that a
  request claims without verified marks is moved aside, so approximate KV never reaches a
  plain or exact request. Turns of SGLang sessions run exact: a streaming session hands
  a turn its history's KV outside the prefix tree's namespaces;
- the request's isolation namespace (its tenant, ``tenants.isolation_namespace`` of the
  client's ``extra_key`` and ``cache_salt``) is fixed here and travels in ``Pending``, so
  every chunk tier stores and finds its chunks under it alone, plus the server's public
  namespaces when the request asks for the public scope (refused where none is shared).
  Marks carrying a key of ours besides the signed ones are forged and not honoured;
- a deletion order (``delete_command``) is executed here only when the per-launch secret
  signed it, and the request is refused with its report (the HTTP edge reads it back);
  an order without a valid MAC is refused, counted and never executed.

Never raises: a failure inside the gate means exact prefill for that request.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sgl_pic.config import PicConfig
from sgl_pic.core import delete_command
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.spans import (
    INTERNAL_PREFIX,
    MARK_KEYS,
    LimitError,
    MarkSigner,
    PicRequest,
    decode,
    has_marks,
)
from sgl_pic.core.tenants import DEFAULT_NAMESPACE, TenantPolicy, isolation_namespace
from sgl_pic.layout import LayoutError
from sgl_pic.store.base import hash_token_ids
from sgl_pic.store.deletion import segment_contents

logger = logging.getLogger(__name__)

# Admitted requests whose marks wait at once, at most: far more than SGLang's running and
# waiting requests together; past it the oldest entry goes (that request runs exact).
MAX_ADMITTED = 1 << 16
# Requests claiming one of our namespaces without verified marks are moved under this one,
# which only ever holds exact KV of such requests.
UNTRUSTED_NAMESPACE = "untrusted-namespace:"


class EncodingContext(NamedTuple):
    """What a prompt's chunks past its first are encoded after (``encoding_context``):
    the prompt's tokens [0, ``end``), which ``digest`` names with where its first chunk
    starts, and ``contents``, the content digests of that first chunk's segments, which
    records encoded after it carry (``ChunkKV.context_contents``)."""

    end: int = 0
    digest: str = ""
    contents: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pending:
    """A chunked request's verified marks and the exact token ids they were verified for;
    the executor uses them only for a request whose ids still equal ``token_ids``.

    namespace: the isolation namespace its chunks are stored under and found in.
    readable:  the namespaces its lookups may hit, ``namespace`` first (then the public
               ones it asked for).
    encoding:  what its chunks from ``encoding.end`` on are encoded after
               (``encoding_context``); empty when every chunk is encoded alone."""

    request: PicRequest
    token_ids: tuple[int, ...]
    namespace: str = DEFAULT_NAMESPACE
    readable: tuple[str, ...] = (DEFAULT_NAMESPACE,)
    encoding: EncodingContext = EncodingContext()

    def context_for(self, start: int) -> EncodingContext:
        """What the chunk starting at ``start`` is encoded after: ``encoding``, or the
        empty context for a chunk encoded alone (the first, or every chunk without one)."""
        enc = self.encoding
        return enc if enc.digest and start >= enc.end else EncodingContext()

    def context_of(self, start: int) -> str:
        """``context_for(start)``'s digest, what the chunk's keys name; "" alone."""
        return self.context_for(start).digest

    def context_computed(self, start: int, prefix: int) -> bool:
        """Whether phase 1 computes the context with a miss at ``start`` rather than read
        it from the request's slots: those hold it as exact prefill does only when the
        device prefix (``prefix`` tokens) covers it and the first chunk starts the prompt
        (that chunk's KV, reused or computed, then has nothing before it)."""
        if not self.context_of(start):
            return False
        first = self.request.layout.chunks[0]
        return first.start != 0 or self.encoding.end > prefix


def encoding_context(config: PicConfig, layout: Any, token_ids: Sequence[int]) -> EncodingContext:
    """The encoding context of a prompt with ``layout``'s chunks: under
    ``chunk_context="first_chunk"`` with two chunks or more, the tokens through the first
    chunk; else none. Its digest names the first chunk's start too, so equal digests mean
    an equal first chunk, and equal ``contents``."""
    chunks = layout.chunks
    if config.chunk_context == "none" or len(chunks) < 2:
        return EncodingContext()
    first = chunks[0]
    h = hashlib.sha256(b"sgl_pic.encoding_context\0")
    h.update(first.start.to_bytes(8, "little"))
    h.update(hash_token_ids(token_ids[: first.end]).encode())
    contents = segment_contents(token_ids[first.start : first.end], config.segment_tokens)
    return EncodingContext(first.end, h.hexdigest(), tuple(sorted(contents)))


class AdmittedMarks:
    """Verified marks of admitted requests, by SGLang request id (rid), from admission
    until the request ends. The gate puts them (scheduler side, ``AdmissionGate.admit``);
    the runtime reads them for each batch SGLang prepares (a request keeps its marks over
    every extend it takes: chunked-prefill pieces, a resume after a retraction); the radix
    cache drops them when SGLang releases a finished request's KV or releases an aborted
    one (``ChunkRadixCache``), so entries of requests that end without an extend do not
    pile up. ``capacity`` bounds it besides: past it the oldest entry goes, counted in
    ``dropped`` (its request runs exact). All calls come from the scheduler's thread."""

    def __init__(self, capacity: int = MAX_ADMITTED) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._by_rid: OrderedDict[str, Pending] = OrderedDict()

    def put(self, rid: str, pending: Pending) -> None:
        self._by_rid[rid] = pending
        self._by_rid.move_to_end(rid)
        while len(self._by_rid) > self.capacity:
            old, _ = self._by_rid.popitem(last=False)
            self.dropped += 1
            logger.warning("sgl_pic: marks of request %s dropped (%d waiting)", old, self.capacity)

    def get(self, rid: str) -> Pending | None:
        return self._by_rid.get(rid)

    def drop(self, rid: str) -> None:
        """Forgets ``rid``'s marks (none held: nothing happens)."""
        self._by_rid.pop(rid, None)

    def __len__(self) -> int:
        return len(self._by_rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid


def namespace(
    config: PicConfig, user_key: str | None, calibrated_r: bool = False, generation: int = 0
) -> str:
    """The prefix-tree namespace (SGLang's ``extra_key``) of a chunked request.
    ``calibrated_r``: CacheTune's r is the server's calibrated r of the slowest tier the
    request reuses from (``planner.calibrated``), known only when its batch runs; such
    requests make one approximation, "calibrated", whatever r the config names (a config
    r of 1.0 would otherwise claim the exact namespace).
    ``generation``: deletions executed so far (``Deleter.generation``). Each deletion moves
    every chunked request to fresh namespaces, so no later request matches a tree node
    made before it, not even one a running request still holds (SGLang cannot evict a
    locked node) or inserts when it finishes. It stands before the first "|", which
    no approximation key holds, so no client key can imitate it."""
    key = config.approximation_key()
    if calibrated_r:
        key = f"cachetune,calibrated,{config.cachetune_alpha!r}"
    if generation:
        key = f"{key}@{generation}"
    return f"{INTERNAL_PREFIX}:{key}|{user_key or ''}"


def restamped(extra_key: object, generation: int) -> str | None:
    """``extra_key`` moved to ``generation`` when it is a chunked request's tree namespace
    (``namespace``) of an earlier generation; None for any other key. A request admitted
    before a deletion and matched after it must not reach the tree KV of its old
    namespace (``ChunkRadixCache.match_prefix``)."""
    if not isinstance(extra_key, str) or not extra_key.startswith(INTERNAL_PREFIX + ":"):
        return None
    head, sep, user = extra_key.partition("|")
    if not sep:
        return None
    key = head[len(INTERNAL_PREFIX) + 1 :]
    base, at, stamp = key.rpartition("@")
    if not (at and stamp.isdigit()):  # generation 0 carries no stamp
        base, stamp = key, "0"
    if int(stamp) >= generation:
        return None
    return f"{INTERNAL_PREFIX}:{base}@{generation}|{user}"


def first_out_of_vocab(
    token_ids: Sequence[int], vocab_size: int, allowed: frozenset[int] = frozenset()
) -> tuple[int, int] | None:
    """(index, id) of the first id outside [0, vocab_size) and not in ``allowed``, or
    None."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None
    return next(
        ((i, int(t)) for i, t in enumerate(token_ids) if not (0 <= t < vocab_size or t in allowed)),
        None,
    )


def multimodal_pad_ids(req: Any) -> frozenset[int]:
    """The placeholder ids SGLang put in ``req``'s input ids for its images, audio or
    video (each item's pad values, at least 1,000,000: outside any vocabulary by design,
    replaced by the item's embeddings in the forward)."""
    items = getattr(getattr(req, "multimodal_inputs", None), "mm_items", None) or ()
    out: set[int] = set()
    for item in items:
        values = getattr(item, "pad_values", None) or (getattr(item, "pad_value", None),)
        out.update(int(v) for v in values if v is not None)
    return frozenset(out)


class Refusal(NamedTuple):
    """Why a request is refused: ``reason`` labels ``requests_refused``, ``message`` is
    what SGLang answers the client."""

    reason: str
    message: str


def input_refusal(req: Any, ids: Sequence[int], vocab_size: int) -> Refusal | None:
    """The refusal of SGLang's ``req`` (its input ids ``ids``) for inputs that would crash
    SGLang 0.5.23's scheduler (a token id outside the vocabulary, a count of top logprobs
    outside [0, ``vocab_size``]), or None. Pure: the caller counts and answers it."""
    bad = first_out_of_vocab(ids, vocab_size, multimodal_pad_ids(req))
    if bad is not None:
        return Refusal(
            "token_id",
            f"input_ids[{bad[0]}] = {bad[1]} is outside the vocabulary [0, {vocab_size})",
        )
    top = getattr(getattr(req, "logprob", None), "top_logprobs_num", 0)
    if getattr(req, "return_logprob", False) and not (type(top) is int and 0 <= top <= vocab_size):
        # SGLang 0.5.23 takes a top-k of that many logprobs in the scheduler, and a k
        # past the vocabulary kills it.
        return Refusal("top_logprobs", f"top_logprobs_num = {top!r} is outside [0, {vocab_size}]")
    return None


def exact_only_reason(req: Any, custom: Any) -> str | None:
    """Why SGLang's ``req``, whose marks ``custom`` verified, still runs exact (the
    ``marks_ignored`` reason), or None when nothing in it rules chunk reuse out."""
    if any(
        isinstance(k, str) and k.startswith(INTERNAL_PREFIX) and k not in MARK_KEYS for k in custom
    ):
        # A key of ours the MAC does not cover (a namespace, say) was added to signed
        # marks: nothing of ours reads it, but the marks are not what we signed.
        return "bad_signature"
    if getattr(req, "lora_id", None):
        # Chunk keys name the base model's weights, not an adapter's.
        return "lora"
    if getattr(req, "return_hidden_states", False) is True:
        # Every prompt row's hidden state is asked for, and the chunk path computes only
        # the recomputed rows ("last" asks for the last row, which it always computes).
        return "hidden_states"
    if getattr(req, "session", None) is not None:
        # A streaming session lends each turn the session's own KV whatever the
        # namespace, so an approximate turn would reach a later exact one; any session
        # turn runs exact.
        return "session"
    return None


class CheckedMarks(NamedTuple):
    """A request's marks decoded (``pic``), or why they are not honoured (``reason``, the
    ``marks_ignored`` label; ``pic`` is then None)."""

    pic: PicRequest | None
    reason: str = ""


def decoded_marks(custom: Any, config: PicConfig, num_tokens: int) -> CheckedMarks:
    """The verified marks ``custom`` decoded under the server's ``config`` for a prompt
    of ``num_tokens`` tokens: "limit" past the server's limits, "malformed" for marks
    that do not decode or whose layout covers another number of tokens."""
    try:
        pic = decode(custom, config)
    except LimitError:
        return CheckedMarks(None, "limit")
    except LayoutError:
        return CheckedMarks(None, "malformed")
    if pic.layout.num_tokens != num_tokens:
        return CheckedMarks(None, "malformed")
    return CheckedMarks(pic)


class AdmissionGate:
    """signer: None when reuse is off in this process (SGLang's own launcher gave no
    secret, or the attention backend is not supported): then no marks are honoured.
    calibrated_r: whether the executor sets CacheTune's r per tier (``--pic-calibrate``);
    its requests then share the "calibrated" namespace (``namespace``).
    tenants: which namespaces a request asking for the public scope may read (none by
    default).
    deleter: executes signed deletion orders (``deleter.Deleter``); None where this process
    keeps no chunk KV (reuse off): orders are then refused.
    marks: where honoured marks go, by request id (``AdmittedMarks``; a fresh one if
    None). Scheduler side: ``admit`` runs on the scheduler's thread."""

    def __init__(
        self,
        config: PicConfig,
        signer: MarkSigner | None,
        vocab_size: int,
        metrics: PicMetrics,
        calibrated_r: bool = False,
        tenants: TenantPolicy | None = None,
        deleter: Any = None,
        marks: AdmittedMarks | None = None,
    ) -> None:
        self.config = config
        self.marks = marks if marks is not None else AdmittedMarks()
        self.deleter = deleter
        self.tenants = tenants or TenantPolicy()
        self.signer = signer
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.calibrated_r = calibrated_r  # the executor runs CacheTune at calibrated r

    def admit(self, req: Any) -> str | None:
        """Checks SGLang's ``Req`` before it is queued: an error message to refuse it with,
        or None. Rewrites ``req.extra_key`` and its custom params, and puts a request's
        ``Pending`` into ``marks`` under its rid when its marks are honoured."""
        try:
            return self._admit(req)
        except Exception:  # noqa: BLE001 - a request must never stop the scheduler
            logger.exception("sgl_pic: admission of request %s failed", getattr(req, "rid", "?"))
            self._ignore(req, "internal_error")
            return None

    def _admit(self, req: Any) -> str | None:
        """``admit`` without its guard: raises on an internal failure."""
        # Marks kept under this request id belong to an earlier request of the same id
        # (SGLang refuses concurrent duplicates, not reuse after one ended without
        # releasing): never this one's, whatever it carries.
        self.marks.drop(req.rid)
        ids = req.origin_input_ids
        refusal = input_refusal(req, ids, self.vocab_size)
        if refusal is not None:
            self.metrics.requests_refused.labels(reason=refusal.reason).inc()
            return refusal.message
        custom = getattr(req.sampling_params, "custom_params", None)
        if delete_command.has_command(custom):
            return self._command(req, custom)
        extra = req.extra_key
        claims_namespace = isinstance(extra, str) and extra.startswith(INTERNAL_PREFIX)
        if not (has_marks(custom) or claims_namespace):
            return None
        checked = self._checked(req, ids, custom, claims_namespace)
        if checked.pic is None:
            self._ignore(req, checked.reason)
            return None
        return self._honour(req, ids, extra, checked.pic)

    def _checked(
        self, req: Any, ids: Sequence[int], custom: Any, claims_namespace: bool
    ) -> CheckedMarks:
        """``req``'s marks ``custom`` decoded when they are honoured: signed by this
        server's secret for ``req``'s token ids ``ids``, on a request that claims none of
        our namespaces and may reuse chunks (``exact_only_reason``), within the limits;
        else why not (the ``marks_ignored`` reason)."""
        if claims_namespace or self.signer is None or not self.signer.verify(ids, custom):
            return CheckedMarks(None, "reuse_off" if self.signer is None else "bad_signature")
        reason = exact_only_reason(req, custom)
        if reason is not None:
            return CheckedMarks(None, reason)
        return decoded_marks(custom, self.config, len(ids))

    def _honour(self, req: Any, ids: Sequence[int], extra: Any, pic: PicRequest) -> str | None:
        """Honours ``req``'s decoded marks ``pic`` (for its input ids ``ids``; ``extra``:
        its client's ``extra_key``): sets its tree namespace and puts its ``Pending`` into
        ``marks``; or the refusal message when it asks for a public scope this server does
        not share (counted)."""
        own = isolation_namespace(extra, getattr(req, "cache_salt", None))
        try:
            readable = self.tenants.readable(own, pic.public_scope)
        except PermissionError as e:
            self.metrics.requests_refused.labels(reason="public_scope").inc()
            return str(e)
        config = pic.config(self.config)
        # The same test as ``planner.calibrated``: calibration sets r unless the request did.
        calibrated = (
            self.calibrated_r
            and config.policy == "cachetune"
            and "cachetune_r" not in pic.overrides
        )
        generation = self.deleter.generation if self.deleter is not None else 0
        req.extra_key = namespace(config, extra, calibrated, generation)
        context = encoding_context(self.config, pic.layout, ids)
        self.marks.put(req.rid, Pending(pic, tuple(ids), own, readable, context))
        return None

    def _command(self, req: Any, custom: Any) -> str:
        """Executes a signed deletion order; the refusal message: its report, or why it
        was not executed. Never runs the request."""
        try:
            deletion = delete_command.decode(custom, self.signer)
        except delete_command.CommandError as e:
            self.metrics.requests_refused.labels(reason="forged_command").inc()
            logger.warning("sgl_pic: request %s refused: %s", getattr(req, "rid", "?"), e)
            return str(e)
        if self.deleter is None:
            self.metrics.requests_refused.labels(reason="command_unavailable").inc()
            return "deletion unavailable: chunk reuse is off on this server"
        try:
            report = self.deleter.execute(deletion)
        except Exception as e:  # noqa: BLE001 - a request must never stop the scheduler
            logger.exception("sgl_pic: deletion failed")
            self.metrics.requests_refused.labels(reason="command_failed").inc()
            return f"deletion failed part-way ({type(e).__name__}: {e}); send it again"
        return delete_command.report_message(report)

    def _ignore(self, req: Any, reason: str) -> None:
        """Strips our keys and namespace from ``req``: it runs as exact prefill."""
        self.metrics.marks_ignored.labels(reason=reason).inc()
        logger.warning(
            "sgl_pic: chunk marks of request %s not honoured (%s); it runs as exact prefill",
            getattr(req, "rid", "?"),
            reason,
        )
        sp = req.sampling_params
        custom = getattr(sp, "custom_params", None)
        if isinstance(custom, dict):
            sp.custom_params = {
                k: v
                for k, v in custom.items()
                if not (isinstance(k, str) and k.startswith(INTERNAL_PREFIX))
            }
        extra = getattr(req, "extra_key", None)
        if isinstance(extra, str) and extra.startswith(INTERNAL_PREFIX):
            req.extra_key = UNTRUSTED_NAMESPACE + extra
        rid = getattr(req, "rid", None)
        if isinstance(rid, str):
            self.marks.drop(rid)
