"""Budget windows reset at the UTC boundary by Redis's own clock: a real redis-server under
libfaketime (the `libfaketime` test dependency ships the library), its clock moved by rewriting
the time file, the scripts reading Redis ``TIME`` (no clock override) and no sleeps."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenancy.billing import Budget, Charge, Price, window_index
from tenancy.bucket import Reason
from tenancy.keyspace import open_async
from tenancy.redis_limiter import RedisLimiter
from tests.conftest_redis import RedisProcess
from tests.tenancy.conftest import make_plan

PLAN = make_plan(tokens_per_minute=1_000_000, requests_per_minute=10_000, max_concurrent_requests=1000)
PRICE = Price(input=100_000, cached_input=50_000, output=400_000)  # $0.10 / $0.05 / $0.40 per 1M


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


class RedisClock:
    """Redis's wall clock, frozen at what the libfaketime time file says (re-read at each call)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self, when: float) -> None:
        self.path.write_text(dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%d %H:%M:%S\n"))


@pytest.fixture
def moved_redis(tmp_path: Path) -> Iterator[tuple[str, RedisClock]]:
    import libfaketime

    clock = RedisClock(tmp_path / "faketime")
    clock.set(ts(2026, 12, 31, 23, 59, 50))
    _, env = libfaketime.get_reload_information()
    env = {
        **env,
        "FAKETIME_TIMESTAMP_FILE": str(clock.path),
        "FAKETIME_NO_CACHE": "1",  # re-read the file at each call: the test moves the clock
        "DONT_FAKE_MONOTONIC": "1",  # Redis's timers keep real time; only TIME and expiries move
        "TZ": "UTC",
    }
    server = RedisProcess(tmp_path / "redis", env=env)
    server.start()
    try:
        yield server.url, clock
    finally:
        server.stop()


def charge(budget: Budget, prompt: int) -> Charge:
    return Charge.worst_case((budget,), num_prompt_tokens=prompt, max_tokens=0, model="m", price=PRICE)


async def test_windows_reset_at_the_utc_boundary_of_redis_s_clock(
    moved_redis: tuple[str, RedisClock],
) -> None:
    url, clock = moved_redis
    limiter = RedisLimiter(open_async(url))  # no clock override: the scripts read Redis TIME
    daily = Budget("tokens", 100, "daily")
    monthly = Budget("usd", 100, "monthly")  # 1,000 input tokens at $0.10 per 1M fill it
    try:
        seconds, _ = await limiter.client.time()
        assert seconds == ts(2026, 12, 31, 23, 59, 50)  # Redis runs on the moved clock, not ours
        for request_id, budget, prompt in (("d", daily, 100), ("m", monthly, 1000)):
            decision = await limiter.admit("acme", PLAN, 1, request_id, charge(budget, prompt))
            assert decision.lease is not None
            await limiter.settle(decision.lease, prompt, 0)
        small = Budget("tokens", 10, "daily")
        straddles = await limiter.admit("globex", PLAN, 1, "straddles", charge(small, 5))
        assert straddles.lease is not None
        late = await limiter.admit("acme", PLAN, 1, "late-d", charge(daily, 1))
        assert late.reason is Reason.BUDGET and "2027-01-01T00:00:00Z" in late.message()
        assert (await limiter.admit("acme", PLAN, 1, "late-m", charge(monthly, 10))).reason is Reason.BUDGET

        clock.set(ts(2027, 1, 1, 0, 0, 0))  # midnight by Redis's clock: a new day and a new month
        assert (await limiter.admit("acme", PLAN, 1, "new-d", charge(daily, 100))).admitted
        assert (await limiter.admit("acme", PLAN, 1, "new-m", charge(monthly, 1000))).admitted
        # Admitted before midnight, settled after: not charged to the new window, which never held it.
        await limiter.settle(straddles.lease, 5, 0)
        (state,) = await limiter.budgets("globex", (small,))
        assert (state.used, state.window) == (0, window_index("daily", ts(2027, 1, 1)))
        # The ledger's hours are Redis's too: 2026-12-31's last hour, then 2027's first.
        hour = int(ts(2026, 12, 31, 23) // 3600)
        rows = await limiter.ledger(["acme", "globex"], hour - 1, hour + 2)
        assert [(r.tenant, r.hour, r.requests, r.input) for r in rows] == [
            ("acme", hour, 2, 1100),
            ("globex", hour + 1, 1, 5),
        ]
    finally:
        await limiter.aclose()
