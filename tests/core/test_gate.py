"""The scheduler-side admission gate on stand-ins for SGLang's ``Req`` (no server needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pic.config import PicConfig
from sgl_pic.core import delete_command
from sgl_pic.core.gate import (
    UNTRUSTED_NAMESPACE,
    AdmissionGate,
    AdmittedMarks,
    namespace,
)
from sgl_pic.core.metrics import PicMetrics
from sgl_pic.core.spans import MAC_KEY, MarkSigner, encode
from sgl_pic.engine.chunk_nodes import ChunkNodeTable
from sgl_pic.engine.deleter import Deleter
from sgl_pic.keys import ModelFingerprint
from sgl_pic.layout import PromptLayout
from sgl_pic.store.deletion import Deletion
from tests.support.fakes import FakeAllocator

VOCAB = 100
SIGNER = MarkSigner("secret")
CONFIG = PicConfig(min_chunk_tokens=2, max_chunks=3)
IDS = list(range(10, 30))

# Where the gates of these tests put honoured marks, by request id; emptied per test.
MARKS = AdmittedMarks()


@pytest.fixture(autouse=True)
def _fresh_marks() -> None:
    MARKS._by_rid.clear()


def gate(metrics: PicMetrics, signer: MarkSigner | None = SIGNER) -> AdmissionGate:
    return AdmissionGate(CONFIG, signer, VOCAB, metrics, marks=MARKS)


def req(ids: list[int], custom: dict[str, Any] | None = None, extra: str | None = None) -> Any:
    return SimpleNamespace(
        rid="r1",
        origin_input_ids=ids,
        sampling_params=SimpleNamespace(custom_params=custom),
        extra_key=extra,
    )


def signed(
    ids: list[int], spans: list[list[int]], overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    marks = encode(PromptLayout.from_spans(len(ids), spans), overrides or {})
    return {"user": 1, **marks, MAC_KEY: SIGNER.sign(ids, marks)}


def ignored(metrics: PicMetrics, reason: str) -> float:
    return metrics.marks_ignored.labels(reason=reason)._value.get()


def assert_plain(r: Any) -> None:
    assert r.rid not in MARKS
    assert all(not k.startswith("sgl_pic") for k in r.sampling_params.custom_params or {})
    assert not (r.extra_key or "").startswith("sgl_pic")


def test_signed_marks_are_handed_on_with_a_namespace_per_approximation(
    metrics: PicMetrics,
) -> None:
    r = req(IDS, signed(IDS, [[0, 5], [5, 12]], {"policy": "epic", "epic_k": 3}), "user")
    assert gate(metrics).admit(r) is None
    pending = MARKS.get(r.rid)
    assert pending.token_ids == tuple(IDS)
    assert [(s.start, s.end) for s in pending.request.layout.chunks] == [(0, 5), (5, 12)]
    assert r.extra_key == namespace(CONFIG.with_overrides(policy="epic", epic_k=3), "user")
    assert r.extra_key == "sgl_pic:epic,3|user"


def test_exact_and_approximate_requests_never_share_a_namespace() -> None:
    exact = {
        namespace(PicConfig(policy=p, **kw), None)
        for p, kw in [
            ("full_recompute", {}),
            ("cachetune", {"cachetune_r": 1.0}),
            ("cacheblend", {"cacheblend_ratio": 1.0}),
            ("query_aware", {"qa_ratio": 1.0}),
        ]
    }
    assert exact == {"sgl_pic:exact|"}
    approx = {
        namespace(PicConfig(**kw), None)
        for kw in [{}, {"policy": "full_reuse"}, {"policy": "daric"}, {"policy": "epic"}]
    }
    assert len(approx) == 4 and not approx & exact
    # Settings a policy does not read do not split its namespace.
    assert namespace(PicConfig(epic_k=5), None) == namespace(PicConfig(), None)


@pytest.mark.parametrize(
    ("custom", "extra", "reason"),
    [
        # Internal keys a client wrote itself: no MAC, a forged MAC, a MAC for other tokens.
        (
            {"sgl_pic_chunks": [0, 5], "sgl_pic_num_tokens": 20, "sgl_pic_config": {}},
            None,
            "bad_signature",
        ),
        ({**signed(IDS, [[0, 5]]), MAC_KEY: "0" * 64}, None, "bad_signature"),
        (signed([*IDS[:-1], 99], [[0, 5]]), None, "bad_signature"),
        # A namespace of ours claimed without verified marks.
        ({}, "sgl_pic:full_reuse|", "bad_signature"),
        # Signed but over the server's limits or malformed: plain prefill all the same.
        (signed(IDS, [[0, 1]]), None, "limit"),
        (signed(IDS, [[0, 3], [3, 6], [6, 9], [9, 12]]), None, "limit"),
    ],
)
def test_marks_that_fail_run_as_exact_prefill(
    metrics: PicMetrics, custom: dict[str, Any], extra: str | None, reason: str
) -> None:
    before = ignored(metrics, reason)
    r = req(IDS, custom, extra)
    assert gate(metrics).admit(r) is None
    assert_plain(r)
    assert ignored(metrics, reason) == before + 1
    if extra is not None:
        assert r.extra_key == UNTRUSTED_NAMESPACE + extra


def test_malformed_signed_marks_never_raise(metrics: PicMetrics) -> None:
    bad = {"sgl_pic_chunks": "x", "sgl_pic_num_tokens": True, "sgl_pic_config": {}}
    bad[MAC_KEY] = SIGNER.sign(IDS, bad)
    before = ignored(metrics, "malformed")
    r = req(IDS, bad)
    assert gate(metrics).admit(r) is None
    assert_plain(r)
    assert ignored(metrics, "malformed") == before + 1


def test_without_a_secret_no_marks_are_honoured(metrics: PicMetrics) -> None:
    r = req(IDS, signed(IDS, [[0, 5]]))
    assert gate(metrics, signer=None).admit(r) is None
    assert_plain(r)


@pytest.mark.parametrize(("ids", "index", "value"), [([1, 2, VOCAB], 2, VOCAB), ([-1, 2], 0, -1)])
def test_ids_outside_the_vocabulary_are_refused_by_index(
    metrics: PicMetrics, ids: list[int], index: int, value: int
) -> None:
    error = gate(metrics).admit(req(ids))
    assert error is not None and f"input_ids[{index}] = {value}" in error


def test_an_image_requests_placeholder_ids_are_not_refused(metrics: PicMetrics) -> None:
    # SGLang puts each image item's pad values (>= 1,000,000) in the input ids before
    # this check; only those are let past the vocabulary, and its marks (signed over
    # other ids) are not honoured.
    pad = 623242430658192240
    r = req([1, 2, 3, pad, pad, 4], signed(IDS, [[0, 5]]))
    r.multimodal_inputs = SimpleNamespace(mm_items=[SimpleNamespace(pad_values=(pad,))])
    assert gate(metrics).admit(r) is None
    assert_plain(r)
    r = req([1, pad + 1, 4])
    r.multimodal_inputs = SimpleNamespace(mm_items=[SimpleNamespace(pad_values=(pad,))])
    error = gate(metrics).admit(r)
    assert error is not None and f"input_ids[1] = {pad + 1}" in error
    error = gate(metrics).admit(req([1, pad, 4]))  # no image: refused as before
    assert error is not None and f"input_ids[1] = {pad}" in error


def test_plain_requests_pass_untouched(metrics: PicMetrics) -> None:
    r = req(IDS, {"mine": 1}, "user")
    assert gate(metrics).admit(r) is None
    assert r.extra_key == "user" and r.sampling_params.custom_params == {"mine": 1}
    assert r.rid not in MARKS


def test_a_failure_inside_the_gate_means_exact_prefill(metrics: PicMetrics) -> None:
    r = req(IDS, signed(IDS, [[0, 5]]))
    r.sampling_params = None  # anything the gate trips over
    assert gate(metrics).admit(r) is None


def test_marks_of_a_lora_request_are_not_honoured(metrics: PicMetrics) -> None:
    # Chunk keys name the base model's weights; an adapter's KV differs.
    before = ignored(metrics, "lora")
    r = req(IDS, signed(IDS, [[0, 5]]))
    r.lora_id = "adapter"
    assert gate(metrics).admit(r) is None
    assert_plain(r)
    assert ignored(metrics, "lora") == before + 1


@pytest.mark.parametrize("streaming", [True, False])
def test_marks_of_a_session_turn_are_not_honoured(metrics: PicMetrics, streaming: bool) -> None:
    # A streaming session lends a turn its history's KV outside the namespaces: an
    # approximate first turn would reach a later exact one.
    before = ignored(metrics, "session")
    r = req(IDS, signed(IDS, [[0, 5], [5, 12]]), "user")
    r.session = SimpleNamespace(streaming=streaming)
    assert gate(metrics).admit(r) is None
    assert_plain(r)
    assert r.extra_key == "user"
    assert ignored(metrics, "session") == before + 1


def test_calibrated_cachetune_requests_share_one_namespace_never_exact(
    metrics: PicMetrics,
) -> None:
    # With calibration the executor picks r per tier when the batch runs, so the r the
    # config names (even 1.0, which alone would be exact) says nothing about the KV.
    g = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, calibrated_r=True, marks=MARKS)
    keys = []
    for overrides in ({"policy": "cachetune"}, {"policy": "cachetune", "daric_r": 0.5}):
        r = req(IDS, signed(IDS, [[0, 5]], overrides))
        assert g.admit(r) is None
        keys.append(r.extra_key)
    assert keys[0] == keys[1] == "sgl_pic:cachetune,calibrated,0.5|"
    exact_base = AdmissionGate(
        CONFIG.with_overrides(cachetune_r=1.0), SIGNER, VOCAB, metrics, True, marks=MARKS
    )
    r = req(IDS, signed(IDS, [[0, 5]], {"policy": "cachetune"}))
    assert exact_base.admit(r) is None
    assert r.extra_key == keys[0]
    # A request that sets its own r is not calibrated: its namespace names that r.
    r = req(IDS, signed(IDS, [[0, 5]], {"policy": "cachetune", "cachetune_r": 1.0}))
    assert g.admit(r) is None
    assert r.extra_key == "sgl_pic:exact|"
    # Other policies are untouched by calibration.
    r = req(IDS, signed(IDS, [[0, 5]], {"policy": "epic", "epic_k": 3}))
    assert g.admit(r) is None
    assert r.extra_key == "sgl_pic:epic,3|"


def test_cachetune_alpha_is_not_a_per_request_setting(metrics: PicMetrics) -> None:
    # Every chunk is stored with a ranking at the server's alpha, and keyed by it.
    before = ignored(metrics, "malformed") + ignored(metrics, "limit")
    r = req(IDS, signed(IDS, [[0, 5]], {"policy": "cachetune", "cachetune_alpha": 0.25}))
    assert gate(metrics).admit(r) is None
    assert_plain(r)
    assert ignored(metrics, "malformed") + ignored(metrics, "limit") == before + 1


@pytest.mark.parametrize("top", [VOCAB + 1, -1, 10**6, True, 2.0])
def test_a_top_logprobs_count_outside_the_vocabulary_is_refused(
    metrics: PicMetrics, top: Any
) -> None:
    r = req(IDS)
    r.return_logprob, r.logprob = True, SimpleNamespace(top_logprobs_num=top)
    assert "top_logprobs_num" in (gate(metrics).admit(r) or "")
    ok = req(IDS)
    ok.return_logprob, ok.logprob = True, SimpleNamespace(top_logprobs_num=VOCAB)
    assert gate(metrics).admit(ok) is None
    # Without logprobs SGLang never takes the top-k.
    r.return_logprob = False
    assert gate(metrics).admit(r) is None


@pytest.mark.parametrize(("mode", "honoured"), [(True, False), ("last", True), (False, True)])
def test_marks_of_a_request_for_every_hidden_state_are_not_honoured(
    metrics: PicMetrics, mode: Any, honoured: bool
) -> None:
    # The chunk path leaves rows it does not recompute empty; only the last row is always
    # computed, which is what "last" asks for.
    before = ignored(metrics, "hidden_states")
    r = req(IDS, signed(IDS, [[0, 5], [5, 12]]))
    r.return_hidden_states = mode
    assert gate(metrics).admit(r) is None
    assert (r.rid in MARKS) == honoured
    if not honoured:
        assert_plain(r)
    assert ignored(metrics, "hidden_states") == before + (0 if honoured else 1)


# --------------------------------------------------------------------- deletion orders
class RecordingDeleter:
    """Records the orders it is asked to execute."""

    def __init__(self) -> None:
        self.orders: list[Any] = []

    def execute(self, deletion: Any) -> dict[str, Any]:
        self.orders.append(deletion)
        return {"tiers": {"device": {"records": 3}}}


def refused(metrics: PicMetrics, reason: str) -> float:
    return metrics.requests_refused.labels(reason=reason)._value.get()


def test_a_signed_deletion_order_is_executed_and_refused_with_its_report(
    metrics: PicMetrics,
) -> None:

    deleter = RecordingDeleter()
    g = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, deleter=deleter, marks=MARKS)
    order = Deletion(namespaces=frozenset({"ns-a"}), contents=frozenset({"c1", "c2"}))
    r = req([0], delete_command.encode(order, SIGNER))
    message = g.admit(r)
    assert message is not None and deleter.orders == [order]
    assert delete_command.parse_report(message) == {"tiers": {"device": {"records": 3}}}
    assert r.rid not in MARKS


@pytest.mark.parametrize("forgery", ["unsigned", "other_secret", "mark_mac", "altered"])
def test_a_forged_deletion_order_is_refused_counted_and_never_executed(
    metrics: PicMetrics, forgery: str
) -> None:

    deleter = RecordingDeleter()
    g = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, deleter=deleter, marks=MARKS)
    order = Deletion(namespaces=frozenset({""}))
    custom = delete_command.encode(order, SIGNER)
    payload = custom[delete_command.COMMAND_KEY]
    if forgery == "unsigned":
        del custom[delete_command.COMMAND_MAC_KEY]
    elif forgery == "other_secret":
        custom = delete_command.encode(order, MarkSigner("guessed"))
    elif forgery == "mark_mac":
        # A MAC the edge made for chunk marks is no command's MAC.
        marks = encode(PromptLayout.from_spans(3, [[0, 2]]), {})
        custom[delete_command.COMMAND_MAC_KEY] = SIGNER.sign([0, 1, 2], marks)
    else:
        widened = payload.replace('"namespaces":[""]', '"namespaces":null')
        custom[delete_command.COMMAND_KEY] = widened
    before = refused(metrics, "forged_command")
    message = g.admit(req([0], custom))
    assert message is not None and delete_command.parse_report(message) is None
    assert "not signed" in message
    assert deleter.orders == [] and refused(metrics, "forged_command") == before + 1


def test_a_deletion_order_is_refused_where_reuse_is_off(metrics: PicMetrics) -> None:

    custom = delete_command.encode(Deletion(namespaces=frozenset({""})), SIGNER)
    # No secret in this process: nothing is signed, so nothing executes.
    message = gate(metrics, None).admit(req([0], custom))
    assert message is not None and delete_command.parse_report(message) is None
    # A secret but no chunk KV kept here.
    message = gate(metrics).admit(req([0], custom))
    assert message is not None and "unavailable" in message


def test_a_deletion_that_fails_is_refused_not_run(metrics: PicMetrics) -> None:

    class Failing:
        def execute(self, deletion: Any) -> dict[str, Any]:
            raise OSError("disk gone")

    g = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, deleter=Failing(), marks=MARKS)
    custom = delete_command.encode(Deletion(namespaces=frozenset({""})), SIGNER)
    message = g.admit(req([0], custom))
    assert message is not None and "disk gone" in message


def test_after_a_deletion_chunked_requests_take_fresh_tree_namespaces(
    metrics: PicMetrics,
) -> None:

    table = ChunkNodeTable(FakeAllocator(8), ModelFingerprint(model_id="m", dtype="f32"), 4, 8)
    g = AdmissionGate(CONFIG, SIGNER, VOCAB, metrics, deleter=Deleter(table), marks=MARKS)
    spans = [[0, 5], [5, 12]]
    before = req(IDS, signed(IDS, spans), "user")
    assert g.admit(before) is None
    order = delete_command.encode(Deletion(namespaces=frozenset({""})), SIGNER)
    assert g.admit(req([0], order)) is not None
    after = req(IDS, signed(IDS, spans), "user")
    assert g.admit(after) is None
    # Nodes the earlier request made (or still holds) cannot be matched by later ones.
    assert before.extra_key != after.extra_key
    assert after.extra_key == namespace(CONFIG, "user", generation=1)
    # No client key imitates a generation: it stands before the first "|".
    assert namespace(CONFIG, "user") != namespace(CONFIG, None, generation=1)
    assert after.extra_key != namespace(CONFIG, "@1|user")


def test_admitted_marks_are_bounded_oldest_first() -> None:
    marks = AdmittedMarks(capacity=2)
    pending = [object(), object(), object()]
    for i, p in enumerate(pending):
        marks.put(f"r{i}", p)  # type: ignore[arg-type]
    assert "r0" not in marks and marks.get("r1") is pending[1] and marks.get("r2") is pending[2]
    assert len(marks) == 2 and marks.dropped == 1
    marks.drop("r1")
    marks.drop("never-admitted")
    assert len(marks) == 1


@pytest.mark.sglang
def test_the_gate_leaves_no_attribute_on_sglangs_request(metrics: PicMetrics) -> None:
    """On SGLang's real ``Req``: honoured marks go to the gate's store under the request's
    id; the request gains no attribute (only its namespace and custom params change)."""
    from array import array

    from sgl_pic.binding.cpu_env import activate_cpu_stubs

    activate_cpu_stubs()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req("rid-7", "", array("i", IDS), SamplingParams(custom_params=signed(IDS, [[0, 5]])))
    before = set(vars(r))
    assert gate(metrics).admit(r) is None
    assert set(vars(r)) == before
    pending = MARKS.get("rid-7")
    assert pending is not None and pending.token_ids == tuple(IDS)
    assert r.extra_key is not None and r.extra_key.startswith("sgl_pic:")


def test_a_request_reusing_an_earlier_ones_id_never_gets_its_marks(metrics: PicMetrics) -> None:
    """Marks are kept by request id: a later request of the same id, plain or with marks
    that are not honoured, must not find the earlier one's (with its tenant's namespaces)."""
    g = gate(metrics)
    first = req(IDS, signed(IDS, [[0, 5], [5, 12]]), "tenant-A")
    assert g.admit(first) is None and MARKS.get("r1") is not None
    plain = req(IDS, None, "tenant-B")  # the same rid and tokens, no marks
    assert g.admit(plain) is None
    assert MARKS.get("r1") is None
