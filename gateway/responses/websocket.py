"""The Responses API's WebSocket mode: one socket to `/v1/responses`, one turn per `response.create`
frame, answered with the events of the SSE stream, one JSON text frame each.

    upgrade (GET /v1/responses, Authorization or the key header) -> authenticate, count the
      tenant's open sockets (refused before the upgrade, an HTTP error in OpenAI's shape)
    per frame, in order: {"type": "response.create", ...POST /v1/responses's fields}
      -> the pipeline's turn (limits, budgets, ledger, priority, traces: `Turns.start_turn`)
      -> its events, each echoing the frame's `stream_id` when it gave one
      -> the turn's conversation kept in the socket's cache (`store: false` too), so a
         `previous_response_id` of this socket continues without the store
    a refused turn -> {"type": "error", "status": 400, "error": {...}}; the socket stays usable

Turns run in arrival order (which keeps every `stream_id` lane first in, first out). A turn that
fails evicts the response it continued from the cache (a retry reloads it from the store, or finds
it gone). What the socket holds is bounded: the cache (`websocket_cache_size` responses), the events
not yet read (`websocket_send_buffer_bytes`; past it the turn is ended and the socket closed 1008,
so a slow reader never holds the engine). A drain closes idle sockets and each busy one after its
turn with 1012 (service restart), a code clients reconnect on; at the drain deadline a turn still
running ends with an error event first. Pings are the server's (uvicorn's --ws-ping-interval).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.admission import Caller
from gateway.backend import Body, Reply, Work
from gateway.body import decode_json
from gateway.drain import Drain, deadline_error, draining_error
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.metrics import Metrics
from gateway.responses.conversations import with_ids
from gateway.responses.request import ResponsesRequest, items_of

logger = logging.getLogger("batchgate.gateway")

CLOSE_RESTART = 1012  # service restart: the drain (clients reconnect on it)
CLOSE_POLICY = 1008  # policy violation: the client did not read its events
CLOSE_NORMAL = 1000
# Frames read ahead of the turn running; one more is refused with an error event.
MAX_PENDING_FRAMES = 64
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class TurnLifetime(Protocol):
    """An admitted turn (gateway/pipeline.py `Lifetime`): settle at the stream's end, close once."""

    @property
    def work(self) -> Work: ...

    def settle_if_final(self) -> None: ...

    async def close(self) -> None: ...


class Turns(Protocol):
    """What the socket asks of the pipeline (gateway/app.py wires it)."""

    async def authenticate(self, headers: Mapping[str, str], user: str | None) -> Caller: ...

    async def start_turn(
        self, body: dict[str, Any], caller: Caller, cached: Mapping[str, tuple[dict[str, Any], ...]]
    ) -> tuple[TurnLifetime, Reply]: ...


class SocketCache:
    """A socket's recent responses, each as the conversation a continuation starts with; the least
    recently used goes first past `size`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: collections.OrderedDict[str, tuple[dict[str, Any], ...]] = collections.OrderedDict()

    def put(self, response_id: str, conversation: tuple[dict[str, Any], ...]) -> None:
        self.entries[response_id] = conversation
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def touch(self, response_id: str) -> None:
        if response_id in self.entries:
            self.entries.move_to_end(response_id)

    def evict(self, response_id: str) -> None:
        self.entries.pop(response_id, None)


class OpenSockets:
    """Each tenant's open sockets on this gateway, against its `websocket_max_open`."""

    def __init__(self) -> None:
        self._open: collections.Counter[str] = collections.Counter()

    def take(self, tenant: str, limit: int) -> None:
        if self._open[tenant] >= limit:
            raise APIError(
                ErrorKind.RATE_LIMITED,
                f"Too many open WebSockets: over your plan's websocket_max_open of {limit:,}; "
                "close one or use HTTP.",
                code="websocket_limit_exceeded",
            )
        self._open[tenant] += 1

    def give_back(self, tenant: str) -> None:
        self._open[tenant] -= 1
        if self._open[tenant] <= 0:
            del self._open[tenant]

    def num_open(self, tenant: str) -> int:
        return self._open[tenant]


class _Overflow(Exception):
    """The client has not read `websocket_send_buffer_bytes` of events."""


class _Outbox:
    """Events waiting for the client, bounded in bytes: a put never waits (the engine's stream
    is never held by the socket), and one past the bound raises `_Overflow`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._frames: collections.deque[str | tuple[int, str]] = collections.deque()
        self._num_bytes = 0
        self._ready = asyncio.Event()

    def put(self, frame: str) -> None:
        if self._num_bytes + len(frame) > self.max_bytes and self._frames:
            raise _Overflow
        self._frames.append(frame)
        self._num_bytes += len(frame)
        self._ready.set()

    def close_after(self, code: int, reason: str) -> None:
        """Close the socket once what is queued before has gone out."""
        self._frames.append((code, reason))
        self._ready.set()

    async def get(self) -> str | tuple[int, str]:
        while not self._frames:
            self._ready.clear()
            await self._ready.wait()
        frame = self._frames.popleft()
        if isinstance(frame, str):
            self._num_bytes -= len(frame)
        return frame


def error_event(exc: APIError, stream_id: str | None = None) -> dict[str, Any]:
    """OpenAI's WebSocket error event for a turn refused before it ran (its HTTP status too)."""
    event: dict[str, Any] = {"type": "error", "status": exc.status, "error": dict(exc.body()["error"])}
    if event["error"].get("code") is None:  # the event's schema requires a string (HTTP's may be null)
        event["error"]["code"] = exc.kind.value
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


def parse_frame(raw: str | bytes, max_bytes: int) -> tuple[dict[str, Any], str | None]:
    """A client frame as the create body it carries and its `stream_id`; APIError for a frame
    that is not a `response.create` this server takes (413 past `max_bytes`, as a POST's body)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > max_bytes:
        raise APIError(
            ErrorKind.REQUEST_TOO_LARGE, f"The message is larger than the limit of {max_bytes:,} bytes."
        )
    frame = decode_json(data, "the WebSocket message")  # the same checks as a POST's body
    if not isinstance(frame, dict):
        raise invalid_request("A WebSocket message must be one JSON object.")
    stream_id = frame.get("stream_id")
    if stream_id is not None and not isinstance(stream_id, str):
        raise invalid_request("'stream_id' must be a string.", param="stream_id")
    kind = frame.get("type")
    if kind == "response.steer":
        raise invalid_request("'response.steer' is not supported by this server.", param="type")
    if kind != "response.create":
        raise invalid_request(f"Unsupported event type {kind!r}: send 'response.create'.", param="type")
    body = {k: v for k, v in frame.items() if k not in ("type", "stream_id")}
    if body.get("background"):
        raise invalid_request("'background' is not supported over WebSocket; use HTTP.", param="background")
    body.pop("background", None)
    body["stream"] = True  # implicit over the socket
    return body, stream_id


async def _sse_data(frames: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The `data:` payloads of an SSE stream (one event per frame here; a relayed stream may
    split or join them), comments and `[DONE]` left out."""
    buffer = b""
    async for chunk in frames:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                yield data


class ResponsesSocket:
    """One accepted socket: reads frames, runs their turns in order, writes their events."""

    def __init__(
        self,
        websocket: WebSocket,
        turns: Turns,
        caller: Caller,
        drain: Drain,
        cache_size: int,
        send_buffer_bytes: int,
        count_turn: Callable[[], None],
        max_body_bytes: int,
    ) -> None:
        self.websocket = websocket
        self.max_body_bytes = max_body_bytes
        self.turns = turns
        self.caller = caller
        self.drain = drain
        self.cache = SocketCache(cache_size)
        self.outbox = _Outbox(send_buffer_bytes)
        self.count_turn = count_turn
        self.pending: asyncio.Queue[str | bytes] = asyncio.Queue(MAX_PENDING_FRAMES)
        self.busy = False
        self.closing = False

    async def run(self) -> None:
        with self.drain.on_begin(self._drain_began):
            async with anyio.create_task_group() as tg:
                self._group = tg
                tg.start_soon(self._read)
                tg.start_soon(self._write)
                tg.start_soon(self._run_turns)

    def _close(self, code: int, reason: str) -> None:
        """Close once what is queued has gone out (the writer ends the socket)."""
        if not self.closing:
            self.closing = True
            self.outbox.close_after(code, reason)

    def _drain_began(self) -> None:
        if not self.busy:  # a busy socket closes after its turn
            self._close(CLOSE_RESTART, "server restarting; reconnect")

    def _send(self, event: dict[str, Any] | bytes) -> None:
        data = event if isinstance(event, bytes) else json.dumps(event, separators=(",", ":"))
        self.outbox.put(data.decode() if isinstance(data, bytes) else data)

    async def _read(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                self._group.cancel_scope.cancel()
                return
            raw = message.get("text") or message.get("bytes") or b""
            try:
                self.pending.put_nowait(raw)
            except asyncio.QueueFull:
                too_many = invalid_request(f"More than {MAX_PENDING_FRAMES} turns waiting on this socket.")
                try:
                    self._send(error_event(too_many))
                except _Overflow:  # nor reading what it is sent
                    await self._slow_reader()
                    return

    async def _write(self) -> None:
        while True:
            frame = await self.outbox.get()
            if isinstance(frame, tuple):
                await self.websocket.close(*frame)
                self._group.cancel_scope.cancel()
                return
            await self.websocket.send_text(frame)

    async def _run_turns(self) -> None:
        while not self.closing:
            raw = await self.pending.get()
            if self.drain.draining:
                self._close(CLOSE_RESTART, "server restarting; reconnect")
                return
            self.busy = True
            self.drain.enter()
            try:
                await self._turn(raw)
            except _Overflow:
                await self._slow_reader()
                return
            finally:
                self.busy = False
                self.drain.exit()
            if self.drain.draining:
                self._close(CLOSE_RESTART, "server restarting; reconnect")

    async def _slow_reader(self) -> None:
        logger.warning("%s: WebSocket client not reading; closed", self.caller.name or "open")
        await self.websocket.close(CLOSE_POLICY, "send buffer full: the client reads too slowly")
        self._group.cancel_scope.cancel()

    async def _turn(self, raw: str | bytes) -> None:
        stream_id: str | None = None
        previous: str | None = None
        try:
            body, stream_id = parse_frame(raw, self.max_body_bytes)
            named = body.get("previous_response_id")
            previous = named if isinstance(named, str) else None
            lifetime, reply = await self.turns.start_turn(body, self.caller, self.cache.entries)
        except APIError as exc:
            self._send(error_event(exc, stream_id))
            if previous is not None:
                self.cache.evict(previous)
            return
        self.count_turn()
        response: dict[str, Any] | None = None
        try:
            if isinstance(reply, Body):  # refused whole by a replica
                self._whole(reply, stream_id)
            else:
                response = await self._stream(reply.frames, lifetime, stream_id)
        except APIError as exc:  # failed mid-stream (the store, a replica): the turn's last event
            self._send(error_event(exc, stream_id))
        finally:
            await lifetime.close()
        if previous is not None and response is None:
            self.cache.evict(previous)  # a failed continuation: its start is not trusted again
        elif previous is not None:
            self.cache.touch(previous)
        if response is not None:
            req = lifetime.work.request
            assert isinstance(req, ResponsesRequest)
            # A conversation's stored turn is continued from the store: a record that links to
            # one is not read whole (gateway/responses/store.py), so none may link to it.
            if req.conversation_id is None or not req.stores:
                conversation = (*req.history, *with_ids(items_of(req)), *response.get("output", ()))
                self.cache.put(str(response["id"]), tuple(conversation))

    def _whole(self, reply: Body, stream_id: str | None) -> None:
        payload = reply.payload if isinstance(reply.payload, bytes) else json.dumps(reply.payload).encode()
        try:
            detail = json.loads(payload)["error"]
            error = APIError(ErrorKind.INTERNAL, str(detail["message"]), param=detail.get("param"))
        except (ValueError, KeyError, TypeError):
            error = APIError(ErrorKind.INTERNAL, "The server had an error while processing your request.")
        event = error_event(error, stream_id)
        event["status"] = reply.status
        self._send(event)

    async def _stream(
        self, frames: AsyncIterator[bytes], lifetime: TurnLifetime, stream_id: str | None
    ) -> dict[str, Any] | None:
        """Send a turn's events; the response of its terminal event when it completed (or ended
        incomplete), None when it failed."""
        response: dict[str, Any] | None = None
        failed = False
        stopped = anyio.CancelScope()
        try:
            with stopped, self.drain.on_stop(stopped.cancel):
                async with contextlib.aclosing(_sse_data(frames)) as events:
                    async for data in events:
                        terminal = data.startswith(_TERMINAL_HEADS)
                        failed = failed or data.startswith(_FAILED_HEADS)
                        if stream_id is None and not terminal:
                            self._send(data)  # as it came: no parse per delta
                            continue
                        event = json.loads(data)
                        if terminal:
                            response = event["response"]
                        if stream_id is not None:
                            event["stream_id"] = stream_id
                        self._send(event)
                lifetime.settle_if_final()
        finally:
            with anyio.CancelScope(shield=True):  # the backend's stream ends (and frees) here
                aclose = getattr(frames, "aclose", None)
                if aclose is not None:
                    await aclose()
        if stopped.cancelled_caught:  # the drain deadline: this turn ends with an error event
            self._send(error_event(deadline_error(), stream_id))
            self._close(CLOSE_RESTART, "server restarting; reconnect")
            return None
        return None if failed else response


_TERMINAL_HEADS = tuple(f'{{"type":"{kind}"'.encode() for kind in sorted(_TERMINAL))
_FAILED_HEADS = (b'{"type":"response.failed"', b'{"type":"error"')


async def refuse(websocket: WebSocket, exc: APIError) -> None:
    """Refuse an upgrade with the HTTP error (status, OpenAI's body) where the server can send one,
    else close before accepting (the client sees a 403)."""
    try:
        await websocket.send_denial_response(exc.to_response())
    except RuntimeError:
        await websocket.close(CLOSE_POLICY, exc.message[:120])


class ResponsesSockets:
    """The `/v1/responses` WebSocket route: authenticate the upgrade, count the tenant's open
    sockets, then serve the socket."""

    def __init__(
        self,
        turns: Turns,
        drain: Drain,
        max_open: Callable[[Caller], int],
        cache_size: int,
        send_buffer_bytes: int,
        metrics: Metrics,
        max_body_bytes: int,
    ) -> None:
        self.turns = turns
        self.max_body_bytes = max_body_bytes  # of one frame, as of a POST's body
        self.drain = drain
        self.max_open = max_open  # the caller's tenant's websocket_max_open (gateway/bounds.py)
        self.cache_size = cache_size
        self.send_buffer_bytes = send_buffer_bytes
        self.metrics = metrics
        self.open = OpenSockets()

    async def serve(self, websocket: WebSocket) -> None:
        try:
            if self.drain.draining:
                raise draining_error()
            caller = await self.turns.authenticate(websocket.headers, None)
            self.open.take(caller.name, self.max_open(caller))
        except APIError as exc:
            if exc.refusal is not None:
                self.metrics.refused(exc.refusal)
            await refuse(websocket, exc)
            return
        self.metrics.websockets_open.inc()
        try:
            await websocket.accept()
            socket = ResponsesSocket(
                websocket,
                self.turns,
                caller,
                self.drain,
                self.cache_size,
                self.send_buffer_bytes,
                self.metrics.websocket_turns.inc,
                self.max_body_bytes,
            )
            with contextlib.suppress(WebSocketDisconnect):
                await socket.run()
        finally:
            self.open.give_back(caller.name)
            self.metrics.websockets_open.dec()
