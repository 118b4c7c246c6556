"""Graceful drain on SIGTERM/SIGINT, as vLLM's ``--shutdown-timeout`` and TGI's
``--graceful-termination-timeout``.

    SIGTERM -> draining: /ready 503 ("draining"), new generation requests 503 + Retry-After
            -> in-flight requests run on, up to --drain-timeout
            -> at the deadline: a stream still running ends with an error event and [DONE];
               a response not yet started is answered 503
            -> uvicorn is told to exit; the lifespan shuts the engine down; exit status 0

Each refusal and error event is in the protocol's words (gateway/errors.py `Dialect`): for the
Messages API a 529 `overloaded_error`, and an `error` event that ends the stream.

`Drain` is the state (shared by the app's handlers, its middleware and the server);
`DrainMiddleware` counts generation requests in flight and refuses new ones while draining;
`DrainingServer` is uvicorn's server with the signal handling taken over. A second signal
during the drain ends it at once (streams still get their error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from types import FrameType

import anyio
import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, Dialects, ErrorKind
from gateway.metrics import MODEL_PATHS  # the requests a drain waits for and refuses

logger = logging.getLogger("batchgate.gateway")

# After the deadline, how long the requests cut short get to send their last event and settle.
DEADLINE_GRACE_S = 5.0
# What a client refused during a drain is told to wait (another replica takes it meanwhile).
DRAIN_RETRY_AFTER_S = 1.0
# Marks a drain refusal, so a gateway in front stops routing here before its next health poll.
DRAINING_HEADER = "x-batchgate-draining"


def draining_error() -> APIError:
    """The 503 a new request gets while the server drains."""
    return APIError(
        ErrorKind.OVERLOADED,
        "The server is shutting down; retry the request.",
        headers={DRAINING_HEADER: "1"},
        retry_after_s=DRAIN_RETRY_AFTER_S,
    )


def deadline_error() -> APIError:
    """The error a request still running at the drain deadline ends with."""
    return APIError(
        ErrorKind.UNAVAILABLE,
        "The server shut down before this request finished; retry the request.",
        retry_after_s=DRAIN_RETRY_AFTER_S,
    )


class Drain:
    """The drain state of one app. Not draining until :meth:`run` (or :meth:`begin`).

    What must stop at the drain deadline registers a callback with :meth:`on_stop` for as long
    as it runs (streams, to end with an error event; the middleware, to answer what has not
    started). Holds no event-loop object until :meth:`run`, so one app may serve on any loop.
    """

    def __init__(self) -> None:
        self.draining = False
        self.deadline_passed = False
        self.num_inflight = 0
        self._on_stop: set[Callable[[], None]] = set()
        self._on_begin: set[Callable[[], None]] = set()
        self._idle: asyncio.Event | None = None  # created by run(), on the server's loop

    def begin(self) -> None:
        self.draining = True
        for callback in list(self._on_begin):
            callback()

    @contextlib.contextmanager
    def on_begin(self, callback: Callable[[], None]) -> Iterator[None]:
        """Call ``callback`` when the drain begins while inside (at once if it has): what holds a
        connection between requests (a WebSocket) closes it then."""
        if self.draining:
            callback()
        self._on_begin.add(callback)
        try:
            yield
        finally:
            self._on_begin.discard(callback)

    def enter(self) -> None:
        self.num_inflight += 1

    def exit(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0 and self._idle is not None:
            self._idle.set()

    @contextlib.contextmanager
    def on_stop(self, callback: Callable[[], None]) -> Iterator[None]:
        """Call ``callback`` if the drain deadline passes while inside (at once if it has)."""
        if self.deadline_passed:
            callback()
        self._on_stop.add(callback)
        try:
            yield
        finally:
            self._on_stop.discard(callback)

    def stop_all(self) -> None:
        """The deadline: everything registered with :meth:`on_stop` is told to stop now."""
        self.begin()
        self.deadline_passed = True
        for callback in list(self._on_stop):
            callback()

    async def run(self, timeout_s: float, grace_s: float = DEADLINE_GRACE_S) -> bool:
        """Drain: True if every request in flight ended within ``timeout_s``; otherwise stop the
        rest (:meth:`stop_all`) and wait up to ``grace_s`` for them to end."""
        self.begin()
        logger.warning("draining: refusing new requests; %d in flight", self.num_inflight)
        start = time.monotonic()
        idle = self._idle = asyncio.Event()
        if self.num_inflight == 0:
            idle.set()
        with anyio.move_on_after(timeout_s):
            await idle.wait()
        if idle.is_set():
            logger.warning("drained in %.1f s", time.monotonic() - start)
            return True
        logger.warning("drain timeout (%.0f s): ending %d requests in flight", timeout_s, self.num_inflight)
        self.stop_all()
        with anyio.move_on_after(grace_s):
            await idle.wait()
        return False


class DrainMiddleware:
    """ASGI middleware over the model endpoints: counts them in flight for the drain,
    refuses new ones while draining (503, Retry-After), and at the drain deadline answers 503 to
    those whose response has not started yet (the handler is cancelled: its cleanup aborts the
    engine sequence and settles the lease). Started streams end themselves (see sse.py). Each
    refusal is in the dialect of the request's protocol (`dialects`; OpenAI's by default)."""

    def __init__(self, app: ASGIApp, drain: Drain, dialects: Dialects | None = None) -> None:
        self.app = app
        self.drain = drain
        self.dialects = dialects or Dialects({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in MODEL_PATHS:
            await self.app(scope, receive, send)
            return
        dialect = self.dialects.of(scope["path"], Headers(scope=scope))
        if self.drain.draining:
            await dialect.error_response(draining_error())(scope, receive, send)
            return
        started = False
        cancel_scope = anyio.CancelScope()

        async def send_and_watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        def cut_short() -> None:
            if not started:
                cancel_scope.cancel()

        self.drain.enter()
        try:
            with cancel_scope, self.drain.on_stop(cut_short):
                await self.app(scope, receive, send_and_watch)
            if cancel_scope.cancelled_caught and not started:
                await dialect.error_response(deadline_error())(scope, receive, send)
        finally:
            self.drain.exit()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM and SIGINT starting a drain of ``drain`` (up to
    ``timeout_s``) before it exits, instead of closing the port at once and re-raising the signal
    (uvicorn's own handling, which exits with -15). A second signal ends the drain at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drainer: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes of the event loop: schedule, do not await.
        if self._loop is None:
            self.should_exit = True
            return
        if not self._signalled:
            self._signalled = True
            self.drain.draining = True  # /ready and new requests see it now; run() does the rest
            logger.warning(
                "received %s: draining (up to %.0f s)", signal.Signals(sig).name, self.drain_timeout_s
            )
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            logger.warning("received %s again: ending the drain now", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._stop_now)

    def _start_drain(self) -> None:
        self._drainer = asyncio.ensure_future(self._drain_then_exit())

    def _stop_now(self) -> None:
        self.drain.stop_all()
        self.should_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self.drain_timeout_s)
        finally:
            self.should_exit = True
