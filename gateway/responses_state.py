"""The Responses API's state: continuing from a stored response, storing answers, and the
`/v1/responses/{id}` routes (retrieve, delete, input_items).

The pipeline (gateway/pipeline.py) calls the two hooks of a stateful endpoint around its backend:

    prepare(work): previous_response_id -> the stored conversation before this turn (404 if this
                   tenant has no such response), as `ResponsesRequest.history`; in gateway-only mode
                   also as the body relayed, with the history in front of `input`
    wrap(work, plan): the answer (a body, or the stream's terminal event) is stored under its id
                   with this turn's input items, when the request `store`s (OpenAI's default)

A replica behind a gateway (an internal caller) neither resolves nor stores: its gateway did and
will, so any gateway of a pool continues any conversation from the shared store.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Caller
from gateway.backend import Body, Call, Plan, Reply, Stream, Work
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.metrics import Metrics
from gateway.response_store import SQLITE_FILE, RedisStore, ResponseStore, SQLiteStore, StoredResponse
from gateway.responses_output import TERMINAL_EVENTS, item_id
from gateway.responses_request import ResponsesRequest, items_of, parse_items
from gateway.settings import Settings

logger = logging.getLogger("batchgate.gateway")

# The accepted-and-ignored fields of a request (gateway/responses_request.py), comma-separated.
IGNORED_HEADER = "x-batchgate-ignored"
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def build_store(settings: Settings, metrics: Metrics) -> ResponseStore:
    """Redis with --redis-url, else SQLite in --storage-dir (in memory without one)."""
    if settings.redis_url:
        return RedisStore(
            settings.redis_url, settings.responses_ttl_s, settings.responses_max_stored, metrics.evicted
        )
    from pathlib import Path

    path = Path(settings.storage_dir) / SQLITE_FILE if settings.storage_dir else None
    return SQLiteStore(path, settings.responses_max_stored, metrics.evicted)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", param=param)


def _with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item if item.get("id") else {**item, "id": item_id(_ITEM_PREFIX[item["type"]])} for item in items]


class ResponsesState:
    """The stateful endpoint hooks and routes over one `ResponseStore` (see the module docstring)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store that fails is a 503, never a silent drop
            logger.error("the response store failed: %r", exc)
            raise APIError(
                ErrorKind.UNAVAILABLE, "The response store is unavailable; retry shortly.", retry_after_s=1.0
            ) from None

    # -- the pipeline's hooks ----------------------------------------------------------------

    async def prepare(self, work: Work) -> None:
        req = work.request
        assert isinstance(req, ResponsesRequest)
        if req.ignored:
            logger.info("%s: accepted and ignored: %s", work.request_id, ", ".join(req.ignored))
        if work.caller.internal or req.previous_response_id is None:
            return
        previous = await self._call(self.store.get(work.caller.name, req.previous_response_id))
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = previous.conversation()
        work.request = req.model_copy(update={"history": parse_items(history)})
        # What a replica renders (it resolves nothing): the history in front of this turn's input.
        work.body = {**work.body, "input": [*history, *items_of(req)]}

    def wrap(self, work: Work, plan: Plan) -> Plan:
        req = work.request
        assert isinstance(req, ResponsesRequest)
        execute = plan.execute
        store = req.stores and not work.caller.internal
        tenant = work.caller.name
        input_items = _with_ids(items_of(req)) if store else []
        history = [i.model_dump(mode="json", by_alias=True, exclude_none=True) for i in req.history]

        async def save(response: dict[str, Any]) -> None:
            await self._call(self.store.put(tenant, StoredResponse(response, input_items, history)))

        async def run(call: Call) -> Reply:
            reply = await execute(call)
            if work.endpoint.count_only:
                call.usage.served = False  # counting generates nothing: its hold is refunded whole
            if req.ignored:
                reply.headers[IGNORED_HEADER] = ", ".join(req.ignored)
            if not store:
                return reply
            if isinstance(reply, Body):
                if reply.status == 200:
                    payload = reply.payload
                    await save(json.loads(payload) if isinstance(payload, bytes) else dict(payload))
                return reply
            return Stream(_saving(reply.frames, save), reply.ready, reply.headers)

        return Plan(plan.num_prompt_tokens, plan.max_num_tokens, run)

    # -- routes --------------------------------------------------------------------------------

    async def _get(self, caller: Caller, response_id: str) -> StoredResponse:
        record = await self._call(self.store.get(caller.name, response_id))
        if record is None:
            raise _not_found(response_id)
        return record

    async def retrieve(self, caller: Caller, request: Request) -> Response:
        if request.query_params.get("stream") in ("true", "1"):
            raise invalid_request(
                "'stream' replays only background responses, which this server does not run."
            )
        record = await self._get(caller, request.path_params["response_id"])
        return JSONResponse(record.response)

    async def delete(self, caller: Caller, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await self._call(self.store.delete(caller.name, response_id)):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, caller: Caller, request: Request) -> Response:
        record = await self._get(caller, request.path_params["response_id"])
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_request("'order' must be 'asc' or 'desc'.", param="order")
        try:
            limit = int(query.get("limit", DEFAULT_LIST_LIMIT))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise invalid_request(f"'limit' must be an integer from 1 to {MAX_LIST_LIMIT}.", param="limit")
        items = record.input_items if order == "asc" else record.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [i.get("id") for i in items]
            if after not in ids:
                raise invalid_request(f"No input item with id '{after}' in this response.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    async def aclose(self) -> None:
        await self.store.aclose()


async def _saving(frames: AsyncIterator[bytes], save: Any) -> AsyncIterator[bytes]:
    """`frames`, with the response of the terminal event stored before that event goes out (so a
    client that reads the end of the stream can retrieve the response at once)."""
    async with contextlib.aclosing(frames) as inner:  # type: ignore[type-var]
        async for frame in inner:
            if frame.startswith(TERMINAL_EVENTS):
                data = frame.split(b"\ndata: ", 1)[1]
                await save(json.loads(data)["response"])
            yield frame
