"""The Responses API's state: continuing from a stored response, storing answers, background
runs, and the `/v1/responses/{id}` routes (retrieve, delete, input_items, cancel).

The pipeline (gateway/pipeline.py) calls the two hooks of a stateful endpoint around its backend:

    prepare(work): previous_response_id (or conversation) -> the stored conversation before this
                   turn (a WebSocket's own cache first; 400 previous_response_not_found if this
                   tenant has no such response), as `ResponsesRequest.history`;
                   in gateway-only mode also as the body relayed, the history in front of `input`
    wrap(work, plan): the answer (a body, or the stream's terminal event) is stored under its id
                   with this turn's input items, when the request `store`s (OpenAI's default), and
                   with `conversation` its input and output items are appended to the conversation
    background(work, plan, call, close): a `background` request, once admitted, runs on without
                   its client (gateway/responses/background.py); the client gets it `queued`

`GET /v1/responses/{id}?stream=true[&starting_after=N]` replays a background response's events
(see gateway/responses/background.py).

A replica behind a gateway (an internal caller) neither resolves nor stores: its gateway did and
will, so any gateway of a pool continues any conversation from the shared store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Caller
from gateway.backend import Body, Call, Plan, Reply, Stream, Work
from gateway.body import read_json
from gateway.drain import deadline_error
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.metrics import Metrics
from gateway.openai.bodies import now
from gateway.responses.background import ACTIVE, BackgroundRuns, Job
from gateway.responses.compaction import (
    Compactor,
    check_compact_body,
    compacted_response,
    estimate_tokens,
    split_at_compaction,
)
from gateway.responses.conversations import Conversations, Turn, guarded, page, with_ids
from gateway.responses.output import TERMINAL_EVENTS, encode, skeleton, stored_events
from gateway.responses.redis_store import RedisStore
from gateway.responses.request import (
    Parent,
    ResponsesRequest,
    items_of,
    parse_responses_request,
)
from gateway.responses.store import (
    SQLITE_FILE,
    Bound,
    ResponseStore,
    SQLiteStore,
    StoredResponse,
    load_response,
    save_response,
)
from gateway.settings import Settings
from gateway.sse import DONE, EventStreamResponse

logger = logging.getLogger("batchgate.gateway")

Saver = Callable[[dict[str, Any]], Awaitable[None]]
# The accepted-and-ignored fields of a request (gateway/responses/request.py), comma-separated.
IGNORED_HEADER = "x-batchgate-ignored"


def build_store(settings: Settings, metrics: Metrics, bound: Bound | None = None) -> ResponseStore:
    """Redis with --redis-url, else SQLite in --storage-dir (in memory without one); `bound`: a
    tenant's most records (default: --responses-max-stored for every tenant)."""
    if settings.redis_url:
        return RedisStore(
            settings.redis_url,
            settings.responses_ttl_s,
            settings.responses_max_stored,
            metrics.evicted,
            bound=bound,
        )
    from pathlib import Path

    path = Path(settings.storage_dir) / SQLITE_FILE if settings.storage_dir else None
    return SQLiteStore(path, settings.responses_max_stored, metrics.evicted, bound=bound)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", param=param)


def previous_not_found(response_id: str) -> APIError:
    """OpenAI's 400 for a `previous_response_id` this tenant has not got (another tenant's reads
    the same as one that never existed), on HTTP and over the WebSocket alike."""
    return APIError(
        ErrorKind.PREVIOUS_RESPONSE_NOT_FOUND,
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
    )


class ResponsesState:
    """The stateful endpoint hooks and routes over one `ResponseStore` (see the module docstring)."""

    def __init__(
        self,
        store: ResponseStore,
        conversations: Conversations,
        background: BackgroundRuns,
        keep_alive_s: float,
        compactor: Compactor,
        max_body_bytes: int,
        lookup_seconds: Callable[[float], None] = lambda s: None,
        compactions: Callable[[], None] = lambda: None,
        store_format: int = 1,
    ) -> None:
        self.store = store
        self.store_format = store_format  # the format responses are written in (gateway/responses/store.py)
        self.compactor = compactor
        self.max_body_bytes = max_body_bytes
        self.compactions = compactions  # counts the histories compacted server-side
        self.lookup_seconds = lookup_seconds  # each continuation's state resolution, timed
        self.keep_alive_s = keep_alive_s  # between SSE keep-alive comments of a replay
        self.conversations = conversations
        self.background = background

    async def _load(self, tenant: str, response_id: str) -> StoredResponse | None:
        if not response_id.startswith("resp_"):
            return None
        return await guarded(load_response(self.store, tenant, response_id))

    async def _continued(self, tenant: str, response_id: str) -> StoredResponse:
        """The stored response a turn continues, with its whole history (a conversation's items
        read back where it links to them); `previous_response_not_found` where there is none."""
        record = await self._load(tenant, response_id)
        if record is None:
            raise previous_not_found(response_id)
        link = record.in_conversation
        if link is None:
            return record
        conversation = await self.conversations.find(tenant, link.conversation_id)
        resolved = record.with_conversation(None if conversation is None else conversation.items)
        if resolved is None:
            raise invalid_request(
                f"Previous response with id '{response_id}' continues conversation "
                f"'{link.conversation_id}', whose items before it have been deleted; continue the "
                "conversation with 'conversation' instead.",
                param="previous_response_id",
            )
        return resolved

    # -- the pipeline's hooks ----------------------------------------------------------------

    async def prepare(self, work: Work) -> None:
        req = work.request
        assert isinstance(req, ResponsesRequest)
        if req.ignored:
            logger.info("%s: accepted and ignored: %s", work.request_id, ", ".join(req.ignored))
        if work.caller.internal:
            return
        if "background" in work.body:  # a replica runs it in the foreground; this gateway waits
            work.body = {k: v for k, v in work.body.items() if k != "background"}
        conversation_id = req.conversation_id
        start = time.perf_counter()
        history: list[dict[str, Any]] = []
        parent: Parent | None = None  # the stored response the history continues (for format 2)
        if conversation_id is not None:
            conversation = await self.conversations.load(work.caller.name, conversation_id, "conversation")
            # Refused before it runs when the conversation is at its bounds (its turn is kept whole).
            self.conversations.check_room(
                work.caller, conversation, "conversation", adding=len(items_of(req))
            )
            history = list(conversation.items)
            parent = conversation.head  # its latest stored response, in format 2 (always final)
        elif req.previous_response_id is not None:
            cached = work.cached.get(req.previous_response_id) if work.cached is not None else None
            if cached is not None:  # the socket's own (gateway/responses/websocket.py)
                history = list(cached)
                # The same items as its stored conversation, if it was stored: a record that
                # links to it is written whole instead where it was not (or in format 1).
                parent = Parent(req.previous_response_id, len(history))
            else:
                previous = await self._continued(work.caller.name, req.previous_response_id)
                history = previous.conversation()
                # Linked only to a response whose record is final: a background one still running
                # is written again (its output, its status), which would change what links to it;
                # and not to one whose history is its conversation's (stored whole instead).
                final = previous.response.get("status") not in ACTIVE
                if previous.version == 2 and final and previous.in_conversation is None:
                    parent = Parent(req.previous_response_id, len(history), previous.response)
        if conversation_id is not None or req.previous_response_id is not None:
            self.lookup_seconds(time.perf_counter() - start)  # a continuation's lookup, timed
        # Compaction (gateway/responses/compaction.py): the items up to the input's last compaction
        # item join the history (each compaction item expanded); a prompt past the request's
        # compact_threshold has its history compacted by the model first.
        input_items = req.input
        split = split_at_compaction(self.compactor.sealer, work.caller.name, items_of(req))
        if split is not None:
            history += split[0]
            input_items = req.input[split[1] :]
        threshold = None if work.endpoint.count_only else req.compact_threshold  # counting runs no model
        if threshold is not None and history:
            if estimate_tokens([*history, *items_of(req)]) > threshold:
                history = await self.compactor.compact_history(work.caller, work.model, history)
                parent = None  # stored whole: it is not the previous conversation
                self.compactions()
        if not history and split is None:
            return
        # Stored items are rendered as they are (never parsed again: gateway/responses/request.py).
        req = req.model_copy(update={"input": input_items})
        work.request = req.model_copy(update={"history": tuple(history), "history_parent": parent})
        # What a replica renders (it resolves nothing): the history in front of this turn's input.
        work.body = {**work.body, "input": [*history, *items_of(req)]}

    def _saver(self, work: Work) -> tuple[bool, list[dict[str, Any]], list[dict[str, Any]], Saver]:
        """Whether `work`'s answer is stored, its input items and history, and the function that
        stores an answer (and appends it to its conversation)."""
        req = work.request
        assert isinstance(req, ResponsesRequest)
        conversation_id = None if work.caller.internal else req.conversation_id
        store = (req.stores or conversation_id is not None) and not work.caller.internal
        tenant = work.caller.name
        input_items = with_ids(items_of(req)) if store else []
        history = list(req.history)

        async def save(response: dict[str, Any]) -> None:
            if req.stores:
                record = _record(req, response, input_items, history)
                await guarded(save_response(self.store, tenant, record, self.store_format))
            if conversation_id is not None:  # the turn's items join the conversation
                turn = Turn(response["id"], response, [i.get("id") for i in history]) if req.stores else None
                await self.conversations.append(
                    tenant, conversation_id, [*input_items, *response["output"]], turn
                )

        return store, input_items, history, save

    def wrap(self, work: Work, plan: Plan) -> Plan:
        req = work.request
        assert isinstance(req, ResponsesRequest)
        execute = plan.execute
        store, _, _, save = self._saver(work)
        if self.in_background(work):
            store = False  # stored by the background run (its lease and cancel mark first)

        async def run(call: Call) -> Reply:
            reply = await execute(call)
            if work.endpoint.count_only:
                call.usage.served = False  # counting generates nothing: its hold is refunded whole
            if req.ignored:
                reply.headers[IGNORED_HEADER] = ", ".join(req.ignored)
            if isinstance(reply, Body):
                if store and reply.status == 200:
                    payload = reply.payload
                    await save(json.loads(payload) if isinstance(payload, bytes) else dict(payload))
                return reply
            events = _Events(_saving(reply.frames, save) if store else reply.frames)
            return Stream(events, reply.ready, reply.headers, stop_frame=events.deadline_frame)

        return Plan(plan.num_prompt_tokens, plan.max_num_tokens, run)

    def in_background(self, work: Work) -> bool:
        req = work.request
        return isinstance(req, ResponsesRequest) and bool(req.background) and not work.caller.internal

    async def run_in_background(
        self, work: Work, plan: Plan, call: Call, close: Callable[[], Awaitable[None]]
    ) -> Response:
        """The admitted `work` run on without its client; the answer is the queued response."""
        req = work.request
        assert isinstance(req, ResponsesRequest)
        _, input_items, history, save = self._saver(work)
        response = skeleton(req, work.request_id, now(), work.model)

        async def finish(answer: dict[str, Any]) -> None:
            # A replica's own id and time are not this one's (a replay's opening events show these).
            await save({**answer, "id": work.request_id, "created_at": response["created_at"]})

        queued = await self.background.start(
            work.caller.name,
            _record(req, response, input_items, history),
            Job(lambda: plan.execute(call), finish, close),
        )
        headers = {"x-request-id": work.request_id}
        if req.ignored:
            headers[IGNORED_HEADER] = ", ".join(req.ignored)
        return JSONResponse(queued, headers=headers)

    # -- routes --------------------------------------------------------------------------------

    async def _get(self, caller: Caller, response_id: str) -> StoredResponse:
        record = await self._load(caller.name, response_id)
        if record is None:
            raise _not_found(response_id)
        return await self.background.view(caller.name, record)

    async def retrieve(self, caller: Caller, request: Request) -> Response:
        stream = _flag(request, "stream")
        starting_after = _starting_after(request)
        record = await self._get(caller, request.path_params["response_id"])
        if not stream:
            return JSONResponse(record.response)
        if not record.response.get("background"):
            raise invalid_request(
                "Streaming a stored response is only supported for responses created with "
                "'background': true.",
                param="stream",
            )
        events = _Events(self._replay(caller.name, record, starting_after))
        return EventStreamResponse(
            events,
            keep_alive_s=self.keep_alive_s,
            stop=self.background.drain,
            stop_frame=events.deadline_frame,
        )

    async def _replay(self, tenant: str, record: StoredResponse, after: int) -> AsyncIterator[bytes]:
        """The events of background `record` after sequence number `after`, then those of its run
        as it moves on, to its terminal event and `[DONE]`."""
        while True:
            final = record.response.get("status") not in ACTIVE
            for event in stored_events(record.response, final):
                if event["sequence_number"] > after:
                    after = event["sequence_number"]
                    yield encode(event)
            if final:
                break
            await self.background.changed(tenant, record.response_id)
            reloaded = await self._load(tenant, record.response_id)
            if reloaded is None:  # deleted while it ran
                detail = _not_found(record.response_id).body()["error"]
                error = {"code": detail["code"], "message": detail["message"], "param": None}
                yield encode({"type": "error", "sequence_number": after + 1, **error})
                break
            record = await self.background.view(tenant, reloaded)
        yield DONE

    async def delete(self, caller: Caller, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        await self._get(caller, response_id)
        await guarded(self.store.delete(caller.name, response_id))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, caller: Caller, request: Request) -> Response:
        record = await self._get(caller, request.path_params["response_id"])
        return JSONResponse(page(record.input_items, request))

    async def cancel(self, caller: Caller, request: Request) -> Response:
        record = await self._get(caller, request.path_params["response_id"])
        return JSONResponse(await self.background.cancel(caller.name, record))

    async def compact(self, caller: Caller, request: Request) -> Response:
        """`POST /v1/responses/compact`: the conversation (stored, then `input`) compacted."""
        body = await read_json(request, self.max_body_bytes)
        model = check_compact_body(body)
        history: list[dict[str, Any]] = []
        previous_id = body.get("previous_response_id")
        if previous_id is not None:
            history = (await self._continued(caller.name, str(previous_id))).conversation()
        if body.get("input") is not None:
            req = parse_responses_request({"model": model, "input": body["input"]})
            items = items_of(req)
            split = split_at_compaction(self.compactor.sealer, caller.name, items)
            history += items if split is None else [*split[0], *items[split[1] :]]
        summary, usage = await self.compactor.summary(caller, model, history)
        return JSONResponse(compacted_response(self.compactor.sealer, caller.name, summary, usage, history))

    async def aclose(self) -> None:
        await self.background.aclose()
        await self.store.aclose()


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "1", "false", "0"):
        raise invalid_request(f"'{name}' must be true or false, got '{value}'.", param=name)
    return value in ("true", "1")


def _starting_after(request: Request) -> int:
    """`starting_after`: the sequence number after which a replay starts (-1: from the start)."""
    value = request.query_params.get("starting_after")
    if value is None:
        return -1
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise invalid_request(
            f"'starting_after' must be a non-negative integer, got '{value}'.", param="starting_after"
        )
    return number


class _Events:
    """A Responses event stream that remembers its last sequence number, so that the event a drain
    deadline ends it with is Responses-shaped and next in sequence (a chat stream's is not)."""

    def __init__(self, frames: AsyncIterator[bytes]) -> None:
        self._frames = frames
        self._seq = -1

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> bytes:
        frame = await anext(self._frames)
        found = _SEQUENCE.search(frame, 0, 200)
        if found is not None:
            self._seq = int(found.group(1))
        return frame

    async def aclose(self) -> None:
        aclose = getattr(self._frames, "aclose", None)
        if aclose is not None:
            await aclose()

    def deadline_frame(self) -> bytes:
        detail = deadline_error().body()["error"]
        event = {
            "type": "error",
            "sequence_number": self._seq + 1,
            "code": detail["code"],
            "message": detail["message"],
            "param": None,
        }
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


_SEQUENCE = re.compile(rb'"sequence_number":(\d+)')


async def _saving(frames: AsyncIterator[bytes], save: Any) -> AsyncIterator[bytes]:
    """`frames`, with the response of the terminal event stored before that event goes out (so a
    client that reads the end of the stream can retrieve the response at once)."""
    async with contextlib.aclosing(frames) as inner:  # type: ignore[type-var]
        async for frame in inner:
            if frame.startswith(TERMINAL_EVENTS):
                data = frame.split(b"\ndata: ", 1)[1]
                await save(json.loads(data)["response"])
            yield frame


def _record(
    req: ResponsesRequest,
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    history: list[dict[str, Any]],
) -> StoredResponse:
    """`response` as stored, with the links its history was read through (format 2)."""
    return StoredResponse(response, input_items, history, parent=req.history_parent)
