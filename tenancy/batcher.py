"""Idempotent script calls sent to Redis in shared round trips, on a connection of their own.

Each call waits for its own reply, so its caller sees what a lone ``EVALSHA`` would answer; the
calls made while a batch is on the wire go out together in the next one (one write, the replies
read in order: a group commit). The connection is not the pool's: no pool lock, no timer per
read, one deadline per batch. This is the settlement path (``RedisLimiter.settle``): through
redis-py's pooled call most of a settlement's cost was the client's, per call (docs/BENCHMARKS.md,
issue 24).

A batch that fails (refused, reset, past the deadline) fails each of its calls with the error,
and the connection is dropped, so no reply of a half-read batch is taken for another's; the next
batch reconnects. A batch on a connection that had worked is sent once more at once when it
breaks (the pool's one immediate retry: Redis restarted under it), which is why the calls must
be idempotent. A call that Redis answers ``NOSCRIPT`` (it forgot the script) is sent again as
``EVAL``, which loads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


@dataclass(frozen=True)
class _Call:
    script: AsyncScript
    keys: Sequence[Any]
    args: Sequence[Any]
    future: asyncio.Future[Any]

    def command(self, load: bool) -> bytes:
        head = ("EVAL", self.script.script) if load else ("EVALSHA", self.script.sha)
        return pack_command((*head, len(self.keys), *self.keys, *self.args))


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


class ScriptBatcher:
    """Sends idempotent script calls of ``client``'s server in shared round trips (see the
    module docstring); ``deadline_s`` bounds one batch, retry included."""

    def __init__(self, client: aioredis.Redis, deadline_s: float) -> None:
        pool = client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        kwargs["socket_timeout"] = None  # the batch's deadline bounds each read and write
        self._conn = pool.connection_class(**kwargs)
        self._deadline_s = deadline_s
        self._queue: list[_Call] = []
        self._sender: asyncio.Task[None] | None = None

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply; raises what the batch met (redis-py's errors, TimeoutError)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Call(script, tuple(keys), tuple(args), future))
        if self._sender is None or self._sender.done():
            self._sender = loop.create_task(self._send_all(), name="redis-batcher")
        return await future

    async def _send_all(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                async with asyncio.timeout(self._deadline_s):
                    replies = await self._round_trip(batch)
            except Exception as exc:
                await self._conn.disconnect(nowait=True)
                for call in batch:
                    if not call.future.done():
                        call.future.set_exception(exc)
                continue
            except BaseException:  # cancelled (aclose): its calls and those queued end with it
                await self._conn.disconnect(nowait=True)
                for call in batch + self._queue:
                    call.future.cancel()
                raise
            for call, reply in zip(batch, replies, strict=True):
                if call.future.done():  # its caller was cancelled
                    continue
                if isinstance(reply, ResponseError):
                    call.future.set_exception(reply)
                else:
                    call.future.set_result(reply)

    async def _round_trip(self, batch: list[_Call]) -> list[Any]:
        replies: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))
        load = False
        retried = not self._conn.is_connected  # a fresh connection that fails is not retried
        while todo:
            try:
                got = await self._exchange([batch[i].command(load) for i in todo])
            except RedisConnectionError:
                await self._conn.disconnect(nowait=True)
                if retried:
                    raise
                retried = True
                continue
            missing = []
            for i, reply in zip(todo, got, strict=True):
                if isinstance(reply, NoScriptError) and not load:
                    missing.append(i)
                else:
                    replies[i] = reply
            todo, load = missing, True
        return replies

    async def _exchange(self, commands: list[bytes]) -> list[Any]:
        conn = self._conn
        if not conn.is_connected:
            await conn.connect()  # type: ignore[no-untyped-call]
        await conn.send_packed_command(b"".join(commands), check_health=False)
        out: list[Any] = []
        for _ in commands:
            try:
                out.append(await conn.read_response())
            except ResponseError as exc:  # this reply only; the next ones follow on the wire
                out.append(exc)
        return out

    async def aclose(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        await self._conn.disconnect()
