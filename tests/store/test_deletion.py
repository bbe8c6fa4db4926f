"""The deletion order and the content digests it names (sgl_pic/store/deletion.py)."""

from __future__ import annotations

import hashlib

import pytest

from sgl_pic.keys import ModelFingerprint, segment_keys
from sgl_pic.store.base import record_content
from sgl_pic.store.deletion import DeleteReport, Deletion, content_digest, segment_contents

NS = "ab" * 32


def test_content_digest_is_sha256_of_little_endian_uint32() -> None:
    tokens = [1, 2, 70000]
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert content_digest(tokens) == hashlib.sha256(raw).hexdigest()
    assert content_digest((1, 2, 70000)) == content_digest(tokens)
    assert content_digest([1, 2]) != content_digest([2, 1])


def test_segment_contents_splits_as_segment_keys() -> None:
    tokens = list(range(10))
    fp = ModelFingerprint(model_id="m", dtype="float32")
    spans = [(k.start, k.end) for k in segment_keys(tokens, fp, segment_tokens=4)]
    assert segment_contents(tokens, 4) == frozenset(content_digest(tokens[a:b]) for a, b in spans)
    assert len(segment_contents(tokens, 4)) == 3
    with pytest.raises(ValueError):
        segment_contents(tokens, 0)
    with pytest.raises(ValueError):
        segment_contents([], 4)


def test_deletion_needs_a_target() -> None:
    with pytest.raises(ValueError):
        Deletion()
    with pytest.raises(ValueError):
        Deletion(namespaces=frozenset())
    with pytest.raises(ValueError):
        Deletion(contents=frozenset())


def test_deletion_matches_namespace_content_and_both() -> None:
    a, b = [1, 2, 3], [4, 5]
    by_ns = Deletion(namespaces=frozenset({NS}))
    assert by_ns.matches(NS, a) and by_ns.matches(NS, b)
    assert not by_ns.matches("", a)
    by_content = Deletion(contents=frozenset({content_digest(a)}))
    assert by_content.matches("", a) and by_content.matches(NS, a)
    assert not by_content.matches(NS, b)
    both = Deletion(namespaces=frozenset({""}), contents=frozenset({content_digest(a)}))
    assert both.matches("", a)
    assert not both.matches(NS, a) and not both.matches("", b)
    assert both.matches_digest("", content_digest(a))
    # Sets given as other iterables are frozen; the order is hashable and comparable.
    assert Deletion(namespaces={NS}) == by_ns  # type: ignore[arg-type]
    assert hash(by_ns) == hash(Deletion(namespaces=frozenset({NS})))


def test_delete_report_fields() -> None:
    r = DeleteReport(records=2, nbytes=64)
    assert (r.records, r.nbytes) == (2, 64)


def test_a_record_content_matches_by_any_of_its_digests() -> None:
    own, context = content_digest([1, 2]), content_digest([3, 4])
    content = record_content(own, (context,))
    assert content == record_content(own, (context,)) and record_content(own) == own
    for named in (own, context):
        assert Deletion(contents=frozenset({named})).matches_digest("", content)
    assert not Deletion(contents=frozenset({content_digest([5])})).matches_digest("", content)
    other_tenant = Deletion(namespaces=frozenset({"a" * 64}), contents=frozenset({context}))
    assert not other_tenant.matches_digest("", content)
