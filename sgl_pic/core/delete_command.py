"""The deletion order as it travels from the HTTP edge to every scheduler rank, and back.

The edge (``delete_http``) cannot reach the schedulers' memory, so an order rides in an
internal generate request: ``custom_params`` carry the order (``COMMAND_KEY``, a JSON
string: custom params must be flat) and its MAC (``COMMAND_MAC_KEY``) under the
per-launch secret that signs chunk marks (``MarkSigner.sign_command``). SGLang hands that
request to every tensor-parallel rank's scheduler, where the gate checks the MAC,
executes the order (``deleter.Deleter``) and refuses the request with ``report_message``;
SGLang turns that refusal into the ``ValueError`` the edge reads back with
``parse_report``. An order whose MAC does not check out is never executed.

Content is named by segment digests (``sgl_pic.store.deletion``): chunk text is tokenized
exactly as the edge tokenizes a marked chunk (each piece on its own, no special tokens),
so its digests are those of the stored segments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from sgl_pic.core.spans import MarkSigner
from sgl_pic.core.tenants import isolation_namespace
from sgl_pic.layout import LayoutError, check_unicode
from sgl_pic.store.deletion import Deletion, segment_contents

COMMAND_KEY = "sgl_pic_delete"
COMMAND_MAC_KEY = "sgl_pic_delete_mac"
# Starts the gate's refusal of an executed order; the JSON report follows.
REPORT_PREFIX = "sgl_pic deletion report: "
# Body fields of POST /pic/delete.
BODY_FIELDS = frozenset({"namespace", "text", "input_ids"})
NAMESPACE_FIELDS = frozenset({"extra_key", "cache_salt"})


class CommandError(ValueError):
    """A command that is not signed by this launch's secret, or malformed."""


def has_command(custom_params: Any) -> bool:
    """Whether ``custom_params`` carries a command key (signed or not)."""
    return isinstance(custom_params, Mapping) and (
        COMMAND_KEY in custom_params or COMMAND_MAC_KEY in custom_params
    )


def encode(deletion: Deletion, signer: MarkSigner) -> dict[str, str]:
    """The custom params carrying ``deletion``, signed."""
    payload = json.dumps(
        {
            "namespaces": None if deletion.namespaces is None else sorted(deletion.namespaces),
            "contents": None if deletion.contents is None else sorted(deletion.contents),
        },
        separators=(",", ":"),
    )
    return {COMMAND_KEY: payload, COMMAND_MAC_KEY: signer.sign_command(payload)}


def decode(custom_params: Mapping[str, Any], signer: MarkSigner | None) -> Deletion:
    """The order ``custom_params`` carry; raises CommandError unless ``signer`` made its
    MAC (None: no secret in this process, nothing is signed) and it is well formed."""
    payload = custom_params.get(COMMAND_KEY)
    if signer is None or not signer.verify_command(payload, custom_params.get(COMMAND_MAC_KEY)):
        raise CommandError("internal command refused: not signed by this server")
    assert isinstance(payload, str)  # verify_command checked
    try:
        data = json.loads(payload)
        return Deletion(
            namespaces=_strings(data["namespaces"]), contents=_strings(data["contents"])
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CommandError(f"internal command malformed: {e}") from e


def _strings(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("expected a list of strings or null")
    return frozenset(value)


def report_message(report: Mapping[str, Any]) -> str:
    return REPORT_PREFIX + json.dumps(report, sort_keys=True, separators=(",", ":"))


def parse_report(message: str) -> dict[str, Any] | None:
    """The report of an executed order from the gate's refusal message; None for any
    other message."""
    if not message.startswith(REPORT_PREFIX):
        return None
    try:
        out = json.loads(message[len(REPORT_PREFIX) :])
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The reports of several data-parallel replicas as one: every count summed."""
    tiers: dict[str, dict[str, int]] = {}
    evicted = 0
    for report in reports:
        evicted += int(report.get("prefix_tree_evicted_tokens", 0))
        for tier, counts in report.get("tiers", {}).items():
            into = tiers.setdefault(tier, {})
            for k, v in counts.items():
                into[k] = into.get(k, 0) + int(v)
    return {"tiers": tiers, "prefix_tree_evicted_tokens": evicted}


def parse_body(
    obj: Any,
    tokenize: Callable[[str], list[int]],
    check_ids: Callable[[Any, str], None],
    segment_tokens: int,
) -> Deletion:
    """The order of a POST /pic/delete body; raises LayoutError with a client-facing
    message for anything malformed.

    namespace: {"extra_key": ..., "cache_salt": ...} as requests name their tenant ({}:
               the default namespace); content: "text" (a chunk's text or a list of them,
               each tokenized as ``tokenize`` does) and/or "input_ids" (one chunk's ids or
               a list of them, each checked by ``check_ids(value, field)``)."""
    if not isinstance(obj, dict):
        raise LayoutError("the body must be a JSON object")
    unknown = sorted(set(obj) - BODY_FIELDS)
    if unknown:
        raise LayoutError(f"unknown field(s) {unknown}; allowed: {sorted(BODY_FIELDS)}")
    namespaces = None
    if "namespace" in obj:
        namespaces = frozenset({_namespace(obj["namespace"])})
    chunks: list[list[int]] = []
    if "text" in obj:
        texts = obj["text"]
        items = [texts] if isinstance(texts, str) else texts
        if not isinstance(items, list) or not items:
            raise LayoutError("'text' must be a chunk's text or a non-empty list of them")
        for i, t in enumerate(items):
            where = "'text'" if isinstance(texts, str) else f"'text'[{i}]"
            if not isinstance(t, str) or not t:
                raise LayoutError(f"{where} must be a non-empty string")
            ids = tokenize(t)
            if not ids:
                raise LayoutError(f"{where} tokenizes to no tokens")
            chunks.append(ids)
    if "input_ids" in obj:
        value = obj["input_ids"]
        if isinstance(value, list) and value and isinstance(value[0], list):
            for i, ids in enumerate(value):
                check_ids(ids, f"input_ids[{i}]")
                chunks.append(ids)
        else:
            check_ids(value, "input_ids")
            chunks.append(value)
    contents = None
    try:
        if chunks:
            contents = frozenset().union(*(segment_contents(c, segment_tokens) for c in chunks))
        if namespaces is None and contents is None:
            raise LayoutError(
                'name what to delete: \'namespace\' (e.g. {"extra_key": "tenant-A"}, {} for '
                "the default), and/or content as 'text' or 'input_ids'"
            )
        return Deletion(namespaces=namespaces, contents=contents)
    except (ValueError, OverflowError) as e:
        # Ids past 32 bits (where the vocabulary is unknown), too many segments.
        raise LayoutError(str(e)) from e


def _namespace(value: Any) -> str:
    if not isinstance(value, dict):
        raise LayoutError(
            "'namespace' must be an object with optional 'extra_key' and 'cache_salt' "
            "({} for the default namespace)"
        )
    unknown = sorted(set(value) - NAMESPACE_FIELDS)
    if unknown:
        raise LayoutError(
            f"unknown field(s) {unknown} in 'namespace'; allowed: {sorted(NAMESPACE_FIELDS)}"
        )
    for k in NAMESPACE_FIELDS:
        if value.get(k) is not None and not isinstance(value[k], str):
            raise LayoutError(f"'namespace.{k}' must be a string or null")
        if isinstance(value.get(k), str):
            check_unicode(value[k], f"'namespace.{k}'")
    return isolation_namespace(value.get("extra_key"), value.get("cache_salt"))
