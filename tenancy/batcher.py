"""Idempotent script calls pipelined to Redis on a connection of their own (the settlement path).

A call is packed and written at once (the calls made in one turn of the event loop share one
write), and its reply is matched to it in order as the bytes arrive (hiredis parses them in the
connection's protocol callback): one round trip and no client-side pool, lock, timer per read or
task per call. Through redis-py's pooled call most of a settlement's cost was the client's
(docs/BENCHMARKS.md, issue 24). redis-py still opens the connection (TLS, AUTH, SELECT), and
its transport is then taken over.

Each call waits at most ``deadline_s`` for its reply. One that times out drops the connection
(a frozen or black-holed Redis), which fails the calls still in flight on it; a call whose
caller was cancelled keeps its place, and its reply is dropped, so no reply is taken for
another's. When a connection that had answered breaks (Redis restarted under it), its calls in
flight are sent once more on a new one, at once, which is why the calls must be idempotent; a
fresh connection that fails fails its calls. A call that Redis answers ``NOSCRIPT`` (it forgot
the script) is sent again as ``EVAL``, which loads it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError


@dataclass(eq=False)
class _Call:
    script: AsyncScript
    keys: Sequence[Any]
    args: Sequence[Any]
    future: asyncio.Future[Any]
    load: bool = False  # sent as EVAL (Redis did not know the script)
    resent: bool = False  # sent again after its connection broke
    packed: bytes = field(default=b"", repr=False)

    def command(self) -> bytes:
        if not self.packed:
            head = ("EVAL", self.script.script) if self.load else ("EVALSHA", self.script.sha)
            self.packed = pack_command((*head, len(self.keys), *self.keys, *self.args))
        return self.packed


def pack_command(args: Sequence[Any]) -> bytes:
    """One command in RESP, as redis-py's encoder writes it (str as UTF-8, numbers by repr), in a
    third of the time of its general packer (``Connection.pack_commands``)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send {type(arg).__name__} to Redis: {arg!r}")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Wire(asyncio.Protocol):
    """One connection's bytes, handed to its batcher (a dropped connection's are ignored)."""

    def __init__(self, batcher: ScriptBatcher, decode: bool) -> None:
        self.batcher = batcher
        self.reader = hiredis.Reader(
            protocolError=InvalidResponse,
            replyError=BaseParser.parse_error,
            **({"encoding": "utf-8"} if decode else {}),
        )
        self.transport: asyncio.Transport | None = None
        self.streams: tuple[Any, ...] = ()  # redis-py's, kept alive with the transport
        self.in_flight: deque[_Call] = deque()  # sent, their replies due in this order
        self.answered = False

    def data_received(self, data: bytes) -> None:
        self.batcher._received(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.batcher._lost(self, exc)


class ScriptBatcher:
    """Pipelines idempotent script calls to ``client``'s server (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, deadline_s: float) -> None:
        pool = client.connection_pool
        self._connection_class = pool.connection_class
        self._kwargs = dict(pool.connection_kwargs)
        self._deadline_s = deadline_s
        self._wire: _Wire | None = None
        self._outbox: list[_Call] = []
        self._flushing: asyncio.Handle | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply; raises what Redis answered (redis-py's errors), its connection's
        error, or TimeoutError past the deadline."""
        if self._closed:
            raise RedisConnectionError("the batcher is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(_Call(script, tuple(keys), tuple(args), future))
        try:
            async with asyncio.timeout(self._deadline_s):
                return await future
        except TimeoutError:
            self._drop(RedisConnectionError("Redis did not answer within the deadline"))
            raise

    def _send(self, call: _Call) -> None:
        self._outbox.append(call)
        wire = self._wire
        if wire is not None and not wire.in_flight and self._flushing is None:
            self._flush()  # an idle connection: at once
        elif self._flushing is None:  # else with the others of this turn of the loop
            self._flushing = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        calls = [c for c in self._outbox if not c.future.done()]  # some callers gave up meanwhile
        if not calls:
            self._outbox.clear()
            return
        wire = self._wire
        if wire is not None and wire.transport is not None and wire.transport.is_closing():
            self._lost(wire, None)  # closed under us, its connection_lost not delivered yet
            wire = None
        if wire is None or wire.transport is None:
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(
                    self._connect(), name="redis-batcher"
                )
            return  # sent once connected
        self._outbox.clear()
        wire.in_flight.extend(calls)
        try:
            wire.transport.write(b"".join(c.command() for c in calls))
        except Exception as exc:  # noqa: BLE001 - uvloop raises RuntimeError on a closed transport
            self._lost(wire, exc)

    async def _connect(self) -> None:
        try:
            conn = self._connection_class(**{**self._kwargs, "socket_timeout": None})
            async with asyncio.timeout(self._deadline_s):
                await conn.connect()  # type: ignore[no-untyped-call]
            # Take over the handshaken transport; redis-py's connection lets go of it (else its
            # __del__ would close it), and its stream objects are kept (a collected StreamWriter
            # closes its transport too).
            streams = (conn._reader, conn._writer)
            assert conn._writer is not None  # connected
            transport = cast(asyncio.Transport, conn._writer.transport)
            conn._reader = conn._writer = None
        except Exception as exc:
            self._connecting = None
            calls, self._outbox = self._outbox, []
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(exc)
            return
        wire = _Wire(self, bool(self._kwargs.get("decode_responses")))
        wire.transport, wire.streams = transport, streams
        transport.set_protocol(wire)
        self._wire, self._connecting = wire, None
        if self._closed:
            transport.close()
            return
        self._flush()

    def _received(self, wire: _Wire, data: bytes) -> None:
        if wire is not self._wire:
            return
        try:
            wire.reader.feed(data)
            while (reply := wire.reader.gets()) is not False:
                call = wire.in_flight.popleft()
                wire.answered = True
                if isinstance(reply, NoScriptError) and not call.load:
                    call.load, call.packed = True, b""
                    self._send(call)
                elif call.future.done():  # its caller was cancelled
                    continue
                elif isinstance(reply, Exception):  # an error reply (LOADING parses as a ConnectionError)
                    call.future.set_exception(reply)
                else:
                    call.future.set_result(reply)
        except (InvalidResponse, IndexError) as exc:  # not Redis speaking: start again
            self._drop(RedisConnectionError(f"bad reply from Redis: {exc!r}"))

    def _lost(self, wire: _Wire, exc: Exception | None) -> None:
        if wire is not self._wire:
            return
        self._wire = None
        error = RedisConnectionError(f"Redis closed the connection: {exc!r}")
        again = []
        for call in wire.in_flight:
            if call.future.done():
                continue
            if wire.answered and not call.resent and not self._closed:
                call.resent = True
                again.append(call)
            else:
                call.future.set_exception(error)
        for call in again:
            self._send(call)

    def _drop(self, error: Exception) -> None:
        """Close the connection and fail its calls in flight with ``error`` (none is resent)."""
        wire, self._wire = self._wire, None
        if wire is None:
            return
        for call in wire.in_flight:
            if not call.future.done():
                call.future.set_exception(error)
        wire.in_flight.clear()
        if wire.transport is not None:
            wire.transport.close()

    async def aclose(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        for call in self._outbox:
            call.future.cancel()
        self._outbox.clear()
        self._drop(RedisConnectionError("the batcher is closed"))
