"""``POST /pic/delete``: the operator's deletion endpoint on SGLang's HTTP server.

Guarded as SGLang 0.5.23 guards its admin endpoints such as ``/flush_cache``: the route
carries ``AuthLevel.ADMIN_OPTIONAL``, which SGLang's own API-key middleware reads
(``sglang.srt.utils.auth``): with ``--admin-api-key`` set only that key opens it, else
with ``--api-key`` set that key, else it is open (as /flush_cache is).

The body names what to delete (``delete_command.parse_body``); a malformed one gets a 400
with what is wrong. The order travels as a signed internal generate request through
SGLang's tokenizer manager to every scheduler rank (``delete_command``), and the report
the gate refuses it with comes back as the 200 answer:
``{"deleted": {"tiers": {"device": {...}, "host": {...}, ...},
"prefix_tree_evicted_tokens": N}, "replicas": R}``. With data parallelism each request
reaches one replica, so the order is sent to every one (``routed_dp_rank``) and their
reports are summed; if any replica does not confirm, the answer is a 503 naming it (the
others have deleted: send the order again, deleting is idempotent).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from sgl_pic.core import delete_command
from sgl_pic.core.spans import MarkSigner
from sgl_pic.layout import LayoutError

DELETE_PATH = "/pic/delete"

# Sends the internal request carrying these custom params to every data-parallel replica;
# per replica, the message SGLang's refusal raised (a ValueError's), or None when the
# request ran (no gate executed it).
Submit = Callable[[dict[str, Any]], Awaitable[list[str | None]]]


async def handle(
    body: bytes,
    tokenize: Callable[[str], list[int]],
    check_ids: Callable[[Any, str], None],
    segment_tokens: int,
    signer: MarkSigner,
    submit: Submit,
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON answer) of one POST /pic/delete body."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return 400, _error(400, f"the body is not JSON: {e}")
    try:
        deletion = delete_command.parse_body(obj, tokenize, check_ids, segment_tokens)
    except LayoutError as e:
        return 400, _error(400, str(e))
    messages = await submit(delete_command.encode(deletion, signer))
    reports = []
    for replica, message in enumerate(messages):
        report = None if message is None else delete_command.parse_report(message)
        if report is None:
            why = message or "the sgl_pic backend is not active"
            where = f" on replica {replica}" if len(messages) > 1 else ""
            return 503, _error(503, f"the scheduler did not execute the deletion{where}: {why}")
        reports.append(report)
    return 200, {"deleted": delete_command.merge_reports(reports), "replicas": len(reports)}


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "code": status}}


async def submit_internal(custom_params: dict[str, Any]) -> list[str | None]:
    """Sends a one-token internal generate request carrying ``custom_params`` through
    SGLang's tokenizer manager to each data-parallel replica in turn (its scheduler
    broadcasts it to every tensor-parallel rank); per replica, the message of the refusal
    it gets (SGLang raises a ValueError for a 400 abort of a non-streaming request), or
    None if it ran."""
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.managers.io_struct import GenerateReqInput

    manager = get_global_state().tokenizer_manager
    replicas = int(getattr(manager, "elastic_worker_count", 1) or 1)
    out: list[str | None] = []
    for rank in range(replicas):
        obj = GenerateReqInput(
            input_ids=[0],  # in every vocabulary; the gate refuses it before a forward
            sampling_params={"max_new_tokens": 1, "custom_params": custom_params},
            routed_dp_rank=rank if replicas > 1 else None,
        )
        try:
            await manager.generate_request(obj, None).__anext__()
        except ValueError as e:
            out.append(str(e))
            continue
        out.append(None)
    return out


def install(app: Any, translator: Any, signer: MarkSigner, segment_tokens: int) -> None:
    """Adds the route to SGLang's FastAPI ``app`` (before the server starts).
    ``translator``: the edge's ``RequestTranslator``, whose tokenization of chunk text
    the order's content digests must match."""
    from sglang.srt.utils.auth import AuthLevel, auth_level
    from starlette.responses import JSONResponse

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def pic_delete(request: Any) -> JSONResponse:  # a starlette Request
        status, answer = await handle(
            await request.body(),
            translator.chunk_ids,
            translator.check_ids,
            segment_tokens,
            signer,
            submit_internal,
        )
        return JSONResponse(answer, status_code=status)

    # A plain Starlette route: the endpoint reads the body itself (no FastAPI model).
    app.add_route(DELETE_PATH, pic_delete, methods=["POST"])
