"""The deletion order between the HTTP edge and the gate: body parsing, signing, report."""

from __future__ import annotations

from typing import Any

import pytest

from sgl_pic.core import delete_command
from sgl_pic.core.spans import MarkSigner
from sgl_pic.core.tenants import isolation_namespace
from sgl_pic.layout import LayoutError
from sgl_pic.store.deletion import Deletion, segment_contents

SIGNER = MarkSigner("secret")
SEG = 4


def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def check_ids(ids: Any, field: str) -> None:
    if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
        raise LayoutError(f"'{field}' must be a non-empty list of token ids")


def parse(obj: Any) -> Deletion:
    return delete_command.parse_body(obj, tokenize, check_ids, SEG)


def test_a_namespace_is_named_as_requests_name_their_tenant() -> None:
    assert parse({"namespace": {"extra_key": "A"}}) == Deletion(
        namespaces=frozenset({isolation_namespace("A", None)})
    )
    assert parse({"namespace": {"cache_salt": "s", "extra_key": "k"}}).namespaces == frozenset(
        {isolation_namespace("k", "s")}
    )
    assert parse({"namespace": {}}).namespaces == frozenset({""})


def test_content_is_named_by_the_segments_of_each_chunk() -> None:
    d = parse({"text": ["abcdefg", "xyz"], "input_ids": [[1, 2, 3, 4, 5]]})
    want = (
        segment_contents(tokenize("abcdefg"), SEG)
        | segment_contents(tokenize("xyz"), SEG)
        | segment_contents([1, 2, 3, 4, 5], SEG)
    )
    assert d.namespaces is None and d.contents == want
    both = parse({"namespace": {"extra_key": "A"}, "text": "abcdefg", "input_ids": [9, 9]})
    assert both.namespaces is not None and both.contents == segment_contents(
        tokenize("abcdefg"), SEG
    ) | segment_contents([9, 9], SEG)


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        ({}, "name what to delete"),
        ([], "JSON object"),
        ({"namespace": "A"}, "'namespace' must be an object"),
        ({"namespace": {"tenant": "A"}}, "unknown field"),
        ({"namespace": {"extra_key": 3}}, "must be a string"),
        ({"text": ""}, "non-empty string"),
        ({"text": []}, "non-empty list"),
        ({"text": [1]}, "'text'[0]"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1], ["x"]]}, "input_ids[1]"),
        ({"everything": True}, "unknown field"),
    ],
)
def test_malformed_bodies_say_what_is_wrong(obj: Any, words: str) -> None:
    with pytest.raises(LayoutError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse(obj)


def test_an_order_survives_the_trip_and_only_its_signer_opens_it() -> None:
    d = Deletion(namespaces=frozenset({"", "ab"}), contents=frozenset({"c"}))
    custom = delete_command.encode(d, SIGNER)
    assert all(k.startswith("sgl_pic") for k in custom)
    assert delete_command.has_command(custom)
    assert delete_command.decode(custom, SIGNER) == d
    for signer in (None, MarkSigner("other")):
        with pytest.raises(delete_command.CommandError):
            delete_command.decode(custom, signer)


def test_reports_are_told_apart_from_other_refusals() -> None:
    report = {"tiers": {"device": {"records": 1}}}
    assert delete_command.parse_report(delete_command.report_message(report)) == report
    assert delete_command.parse_report("Input length (9 tokens) exceeds ...") is None
