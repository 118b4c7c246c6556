"""`unless_disconnected`: the work's result, None when the client left first (the work cancelled,
its cleanup run), and any other cancellation (the drain's deadline, shutdown) passed on."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from starlette.requests import Request

from gateway.body import unless_disconnected


class FakeRequest:
    """What unless_disconnected uses of a request: `receive`, which says `http.disconnect` once
    `leave()` is called (after the body, nothing else comes)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.waiting = 0

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        self.waiting += 1
        try:
            await self.gone.wait()
        finally:
            self.waiting -= 1
        return {"type": "http.disconnect"}


class Work:
    """An awaitable that finishes when `done` is set and records being cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.done = asyncio.Event()
        self.cancelled = False

    async def run(self) -> str:
        self.started.set()
        try:
            await self.done.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "result"


def request(fake: FakeRequest) -> Request:
    return cast(Request, fake)


async def test_the_result_comes_back_and_the_watcher_stops() -> None:
    fake, work = FakeRequest(), Work()
    task = asyncio.ensure_future(unless_disconnected(request(fake), work.run()))
    await work.started.wait()
    assert fake.waiting == 1  # the client is watched while the work runs
    work.done.set()
    assert await task == "result"
    assert fake.waiting == 0 and not work.cancelled


async def test_a_client_that_leaves_cancels_the_work_and_gets_none() -> None:
    fake, work = FakeRequest(), Work()

    async def handler() -> tuple[str | None, int]:
        out = await unless_disconnected(request(fake), work.run())
        this = asyncio.current_task()
        assert this is not None
        return out, this.cancelling()

    task = asyncio.ensure_future(handler())
    await work.started.wait()
    fake.leave()
    out, cancelling = await task
    assert out is None and work.cancelled
    assert cancelling == 0  # the handler itself is not left cancelled: it goes on


async def test_another_cancellation_passes_through_while_the_client_stays() -> None:
    fake, work = FakeRequest(), Work()
    task = asyncio.ensure_future(unless_disconnected(request(fake), work.run()))
    await work.started.wait()
    task.cancel()  # e.g. the drain's deadline
    with pytest.raises(asyncio.CancelledError):
        await task
    assert work.cancelled


async def test_another_cancellation_at_the_same_time_as_the_client_leaving_passes_through() -> None:
    fake, work = FakeRequest(), Work()
    seen: list[int] = []

    async def handler() -> str | None:
        this = asyncio.current_task()
        assert this is not None
        try:
            return await unless_disconnected(request(fake), work.run())
        except asyncio.CancelledError:
            seen.append(this.cancelling())
            raise

    task = asyncio.ensure_future(handler())
    await work.started.wait()
    fake.leave()
    task.cancel()  # both before the handler runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert work.cancelled and seen == [1]  # the other cancellation remains, once
