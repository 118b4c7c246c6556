"""A tenant's batch lane: `batch_tokens_per_minute` paces the lines that start (a fake clock)."""

from __future__ import annotations

import asyncio

from gateway.batches import Lane


def test_lines_start_only_while_the_last_minute_is_under_the_tokens_per_minute() -> None:
    now = [1000.0]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    async def run() -> None:
        lane = Lane(asyncio.Semaphore(4), tokens_per_minute=100, clock=lambda: now[0], sleep=sleep)
        await lane.pace()  # nothing used yet
        lane.spent(60)
        now[0] += 10
        await lane.pace()  # 60 < 100
        lane.spent(50)
        now[0] += 5
        await lane.pace()  # 110 >= 100: until the first line's minute has passed
        assert waits == [45.0] and now[0] == 1060.0
        await lane.pace()  # 50 left in the window
        assert waits == [45.0]
        unpaced = Lane(asyncio.Semaphore(1), tokens_per_minute=None, clock=lambda: now[0], sleep=sleep)
        unpaced.spent(10**9)
        await unpaced.pace()
        assert waits == [45.0]

    asyncio.run(run())
