"""Fixtures for the tenancy tests: a hand-moved clock, plans, and both limiter backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from tenancy.config import Plan
from tenancy.keyspace import open_async
from tenancy.limiter import Limiter, MemoryLimiter
from tenancy.redis_limiter import RedisLimiter


class FakeClock:
    """A clock that moves only when a test says so (seconds, float)."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make_plan(
    tokens_per_minute: int = 600,
    requests_per_minute: int = 600,
    max_concurrent_requests: int = 100,
    priority: str = "paid",
    name: str = "test",
) -> Plan:
    return Plan(
        name=name,
        priority=priority,  # type: ignore[arg-type]
        tokens_per_minute=tokens_per_minute,
        requests_per_minute=requests_per_minute,
        max_concurrent_requests=max_concurrent_requests,
        queue_deadline_seconds=5.0,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


MakeLimiter = Callable[..., Limiter]


@pytest.fixture(params=["memory", "redis"])
async def make_limiter(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[MakeLimiter]:
    """A factory of limiters of one backend, all reading ``clock`` (Redis: via the script's
    clock override), so each case runs unchanged against MemoryLimiter and RedisLimiter."""
    made: list[Limiter] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def make(**kwargs: object) -> Limiter:
        limiter: Limiter
        if url is None:
            limiter = MemoryLimiter(now=clock, **kwargs)  # type: ignore[arg-type]
        else:
            limiter = RedisLimiter(open_async(url), clock=clock, **kwargs)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()
