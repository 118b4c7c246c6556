"""Idempotent script calls pipelined to Redis on one connection of their own, in order (the
limiter's admissions, settlements and budget reads).

A call is packed and written at once when the connection is idle (the calls made in one turn of
the event loop share one write), and its reply is matched to it in order as the bytes arrive
(hiredis parses them in the connection's protocol callback): one round trip and no client-side
pool, lock, timer per read or task per call. Through redis-py's pooled call most of a
settlement's cost was the client's (docs/BENCHMARKS.md, issue 24). redis-py still opens the
connection (TLS, AUTH, SELECT), and its transport is then taken over.

**Order.** Calls are written in the order they were submitted, on one connection, and Redis runs
one connection's commands in that order: a call submitted after another runs after it. `submit`
puts a call on its way without waiting (``flush=True``: written before it returns, with every
call submitted before it); ``wait`` gets its reply. The first call of each script on a
connection is sent as ``EVAL`` (which loads it), so a restarted Redis, which forgot its scripts,
never makes a call answer ``NOSCRIPT`` and be sent again behind calls that came after it (one
that does, after a ``SCRIPT FLUSH`` under a live connection, is sent again as ``EVAL``).

Each call waits at most ``deadline_s`` from its submission for its reply. One that times out
drops the connection (a frozen or black-holed Redis), which fails the calls still in flight on
it; a call whose caller stopped waiting keeps its place, and its reply is dropped, so no reply is
taken for another's. When a connection that had answered breaks (Redis restarted under it), its
calls in flight are sent once more, first and in their order, on a new one, which is why the
calls must be idempotent; a fresh connection that fails fails its calls.
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
class Call:
    """One submitted call: its reply (or error) comes in ``future`` by ``deadline`` (loop time)."""

    script: AsyncScript
    keys: Sequence[Any]
    args: Sequence[Any]
    future: asyncio.Future[Any]
    deadline: float
    load: bool = False  # sent as EVAL after Redis answered NOSCRIPT
    resent: bool = False  # sent again after its connection broke
    tail: bytes = field(default=b"", repr=False)  # the packed keys and args

    def command(self, loaded: set[str]) -> bytes:
        """The call in RESP for a connection that has loaded the scripts in ``loaded`` (EVAL
        for one it has not: that loads it for the calls behind)."""
        if not self.tail:
            self.tail = pack_args((len(self.keys), *self.keys, *self.args))
        count = 3 + len(self.keys) + len(self.args)
        sha = self.script.sha
        if self.load or sha not in loaded:
            loaded.add(sha)
            return b"*%d\r\n" % count + pack_args(("EVAL", self.script.script)) + self.tail
        return b"*%d\r\n" % count + pack_args(("EVALSHA", sha)) + self.tail


def pack_command(args: Sequence[Any]) -> bytes:
    """One command in RESP, as redis-py's encoder writes it (str as UTF-8, numbers by repr), in a
    third of the time of its general packer (``Connection.pack_commands``)."""
    return b"*%d\r\n" % len(args) + pack_args(args)


def pack_args(args: Sequence[Any]) -> bytes:
    """A command's arguments in RESP, without the count that heads them."""
    parts = []
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
        self.in_flight: deque[Call] = deque()  # sent, their replies due in this order
        self.loaded: set[str] = set()  # the scripts sent on this connection (as EVAL, the first time)
        self.answered = False

    def data_received(self, data: bytes) -> None:
        self.batcher._received(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.batcher._lost(self, exc)


class ScriptBatcher:
    """Pipelines idempotent script calls to ``client``'s server, in order (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, deadline_s: float) -> None:
        pool = client.connection_pool
        self._connection_class = pool.connection_class
        self._kwargs = dict(pool.connection_kwargs)
        self._deadline_s = deadline_s
        self._wire: _Wire | None = None
        self._outbox: list[Call] = []
        self._flushing: asyncio.Handle | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply; raises what Redis answered (redis-py's errors), its connection's
        error, or TimeoutError past the deadline."""
        return await self.wait(self.submit(script, keys, args))

    def submit(
        self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any], *, defer: bool = False
    ) -> Call:
        """Put a call on its way, behind every call submitted before it, and return it (its reply
        through :meth:`wait`). It is written at once when the connection is idle, else with the
        others of this turn of the event loop, at its end; ``defer``: at the end of this turn
        even when idle (its caller has something to send first, and does not wait for it).
        Packing and writing happen then, not here. Raises if the batcher is closed."""
        if self._closed:
            raise RedisConnectionError("the batcher is closed")
        loop = asyncio.get_running_loop()
        call = Call(script, tuple(keys), tuple(args), loop.create_future(), loop.time() + self._deadline_s)
        self._outbox.append(call)
        wire = self._wire
        if not defer and wire is not None and not wire.in_flight and self._flushing is None:
            self._flush()  # an idle connection: at once
        elif self._flushing is None:
            self._flushing = loop.call_soon(self._flush)
        return call

    async def wait(self, call: Call) -> Any:
        """The reply to a submitted call (as :meth:`call`). A caller that stops waiting
        (cancelled) leaves the call in its place; its reply is dropped."""
        try:
            async with asyncio.timeout_at(call.deadline):
                return await call.future
        except TimeoutError:
            self._drop(RedisConnectionError("Redis did not answer within the deadline"))
            raise

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
            return  # _lost sent the outbox on (after the calls it resends)
        if wire is None or wire.transport is None:
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(
                    self._connect(), name="redis-batcher"
                )
            return  # sent once connected
        self._outbox.clear()
        wire.in_flight.extend(calls)
        try:
            wire.transport.write(b"".join(c.command(wire.loaded) for c in calls))
        except Exception as exc:  # noqa: BLE001 - uvloop raises RuntimeError on a closed transport
            self._lost(wire, exc)

    async def _connect(self) -> None:
        waiting = set(self._outbox)  # a failed attempt fails these; later calls get one of their own
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
            failed = [c for c in self._outbox if c in waiting]
            self._outbox = [c for c in self._outbox if c not in waiting]
            for call in failed:
                if not call.future.done():
                    call.future.set_exception(exc)
            if self._outbox and not self._closed:
                self._flush()  # submitted during the attempt (Redis may be back by now)
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
                    # Flushed under a live connection (SCRIPT FLUSH): sent again, as EVAL, now
                    # behind the calls sent after it (the one case where the order is not kept).
                    call.load = True
                    self._outbox.append(call)
                    self._flush()
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
        wire.in_flight.clear()
        # The calls sent again go first: they were submitted before those still in the outbox.
        self._outbox[:0] = again
        if self._outbox and not self._closed:
            self._flush()  # a new connection, then all of them in order

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
