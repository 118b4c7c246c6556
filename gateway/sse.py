"""Server-sent events: OpenAI's streaming wire format, keep-alives, and abort on disconnect.

    data: {"id": "chatcmpl-...", "object": "chat.completion.chunk", ...}\\n\\n
    : keep-alive\\n\\n                      <- while nothing was produced for keep_alive_s
    data: {"error": {...}}\\n\\n             <- only if the generation failed mid-stream
    data: [DONE]\\n\\n                       <- always last (also when the server drains: see `stop`)

`EventStreamResponse` is a small ASGI response rather than Starlette's StreamingResponse
because it needs three things at once: (1) to notice a disconnect *while the engine is still
thinking* (uvicorn silently drops writes to a closed socket, so writing would not tell us), (2) to
send keep-alive comments while the next event is not ready, without cancelling the producer, and
(3) to close the producer, shielded from cancellation, on every way out, so the engine aborts the
sequence and frees its blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


class StopSignal(Protocol):
    """What tells a stream to end early (the server's drain deadline, gateway/drain.py)."""

    def on_stop(self, callback: Callable[[], None]) -> AbstractContextManager[None]:
        """Call ``callback`` when the stream must stop, while inside (at once if it already must)."""
        ...


def encode_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class EventStreamResponse(Response):
    """Stream `events` (already-encoded SSE frames) as text/event-stream.

    Contract: `events` is an async generator the response owns. It is closed (`aclose()`, shielded)
    when it is exhausted, when the client disconnects, or when sending fails, so its `finally`
    blocks always run; `on_close` (if given) runs after that. The caller is responsible for
    putting `data: [DONE]` (and any error event) into `events`; `before_done` (if given) is
    called just before `[DONE]` is sent, where a client (the openai SDK) stops reading. When
    `stop` fires (the server's drain deadline) before the stream ends, `events` is closed (the
    engine aborts) and the stream ends with `stop_frame` (an error event) and `data: [DONE]`
    instead of a cut connection.

    Another protocol's stream ends otherwise: `end_frame` is its last frame (Anthropic's
    `message_stop` event), before which `before_done` is called, and `stop_end_frame` what follows
    `stop_frame` (nothing, for Anthropic's: an error event is its last).
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        keep_alive_s: float,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
        before_done: Callable[[], None] | None = None,
        keep_alive_first: bool = False,
        stop: StopSignal | None = None,
        stop_frame: bytes | Callable[[], bytes] = b"",
        end_frame: bytes = DONE,
        stop_end_frame: bytes = DONE,
    ) -> None:
        if keep_alive_s <= 0:
            raise ValueError(f"keep_alive_s must be positive, got {keep_alive_s}")
        # A Response for Starlette's routing; its own __call__ writes the start and body messages.
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.events = events
        self.keep_alive_s = keep_alive_s
        all_headers = {"Content-Type": "text/event-stream; charset=utf-8", **SSE_HEADERS, **(headers or {})}
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in all_headers.items()
        ]
        self.on_close = on_close
        self.before_done = before_done
        self.keep_alive_first = keep_alive_first  # the caller already waited keep_alive_s for a first event
        self.stop = stop
        self.stop_frame = stop_frame
        self.end_frame = end_frame
        self.stop_end_frame = stop_end_frame
        self.disconnected = False
        self.stopped = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send_frames, receive_frames = anyio.create_memory_object_stream[bytes](0)

        async def produce() -> None:
            async with send_frames:
                try:
                    async for frame in self.events:
                        await send_frames.send(frame)
                finally:
                    await self._close_events()

        async def watch_disconnect(cancel_scope: anyio.CancelScope) -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    cancel_scope.cancel()
                    return

        started = ended = False
        stopping = anyio.CancelScope()

        def stop_now() -> None:
            self.stopped = True
            stopping.cancel()

        try:
            with stopping, self.stop.on_stop(stop_now) if self.stop else contextlib.nullcontext():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch_disconnect, tg.cancel_scope)
                    tg.start_soon(produce)
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    started = True
                    if self.keep_alive_first:
                        await send({"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True})
                    async with receive_frames:
                        while True:
                            frame = KEEP_ALIVE
                            with anyio.move_on_after(self.keep_alive_s):
                                try:
                                    frame = await receive_frames.receive()
                                except anyio.EndOfStream:
                                    break
                            if frame == self.end_frame:
                                self._done_comes()
                            await send({"type": "http.response.body", "body": frame, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    ended = True
                    tg.cancel_scope.cancel()
            if self.stopped and not ended and not self.disconnected:
                # Cut short by the drain: abort the producer first, then end the stream properly.
                await self._close_events()
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                last = self.stop_frame() if callable(self.stop_frame) else self.stop_frame
                self._done_comes()
                for frame in (last, self.stop_end_frame):
                    if frame:
                        await send({"type": "http.response.body", "body": frame, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except* OSError:
            # The transport went away while writing (servers other than uvicorn raise here).
            self.disconnected = True
        finally:
            await self._close_events()

    def _done_comes(self) -> None:
        before_done, self.before_done = self.before_done, None
        if before_done is not None:
            before_done()

    async def _close_events(self) -> None:
        with anyio.CancelScope(shield=True):
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            on_close, self.on_close = self.on_close, None
            if on_close is not None:
                await on_close()
