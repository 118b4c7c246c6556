"""A tenant's batch lane (Batch API lines: a charge with `batch`), run against MemoryLimiter and
RedisLimiter (real redis-server) on one hand-moved clock: the lines take nothing of the plan's
interactive tokens, requests or concurrency; `batch_tokens_per_minute` and
`batch_max_concurrent_lines` bound them; both lanes reserve against the same budgets."""

from __future__ import annotations

import dataclasses

import pytest

from tenancy.billing import Budget, Charge
from tenancy.bucket import Reason
from tenancy.limiter import UNLIMITED
from tests.tenancy.conftest import FakeClock, MakeLimiter, make_plan

PLAN = dataclasses.replace(
    make_plan(tokens_per_minute=600, requests_per_minute=2, max_concurrent_requests=1),
    batch_tokens_per_minute=1000,
    batch_max_concurrent_lines=3,
)
BATCH = Charge(batch=True)


async def test_batch_lines_take_nothing_of_the_interactive_limits(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    lines = [await limiter.admit("acme", PLAN, 300, f"line{i}", BATCH) for i in range(3)]
    assert all(d.admitted for d in lines)  # 900 tokens, 3 requests, 3 at once: over every interactive limit
    first = await limiter.admit("acme", PLAN, 600, "i1")
    assert first.admitted and first.remaining_tokens == 0 and first.remaining_requests == 1
    assert (await limiter.admit("acme", PLAN, 0, "i2")).reason is Reason.CONCURRENCY
    assert first.lease is not None and await limiter.settle(first.lease, 600, 0)
    assert (await limiter.admit("acme", PLAN, 0, "i3")).admitted
    assert (await limiter.admit("acme", PLAN, 0, "i4")).reason is Reason.REQUESTS
    # ... and interactive requests take nothing of the batch lane: its 4th line waits for a slot only.
    assert (await limiter.admit("acme", PLAN, 1, "line3", BATCH)).reason is Reason.CONCURRENCY
    for decision in lines:
        assert decision.lease is not None and decision.lease.limits is not None
        assert decision.lease.limits.requests_per_minute == UNLIMITED  # no request rate for lines
        assert await limiter.settle(decision.lease, 100, 50)
    assert (await limiter.admit("acme", PLAN, 1, "line4", BATCH)).admitted


async def test_batch_tokens_per_minute_refill_and_refund_in_their_own_bucket(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    limiter = make_limiter()
    line = await limiter.admit("acme", PLAN, 800, "line0", BATCH)
    assert line.admitted and line.lease is not None
    refused = await limiter.admit("acme", PLAN, 300, "line1", BATCH)
    assert refused.reason is Reason.TOKENS and refused.retry_after_s == pytest.approx(6.0)  # 100 at 1000/min
    assert await limiter.settle(line.lease, 100, 100)  # 600 of its 800 back, to the batch bucket
    assert (await limiter.admit("acme", PLAN, 800, "line2", BATCH)).admitted
    assert (await limiter.admit("acme", PLAN, 600, "i1")).remaining_tokens == 0  # untouched by lines
    too_large = await limiter.admit("acme", PLAN, 1001, "line3", BATCH)
    assert too_large.reason is Reason.TOO_LARGE and too_large.retry_after_s == 0
    clock.advance(60)
    unset = dataclasses.replace(PLAN, batch_tokens_per_minute=None, batch_max_concurrent_lines=None)
    assert all([(await limiter.admit("acme", unset, 10**6, f"big{i}", BATCH)).admitted for i in range(50)])


async def test_both_lanes_hold_against_one_budget_and_expired_lines_release_theirs(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    limiter = make_limiter(lease_ttl_s=5.0)
    budget = Budget("tokens", 1000, "none")
    plan = dataclasses.replace(PLAN, tokens_per_minute=10_000, max_concurrent_requests=10)

    def worst(tokens: int, batch: bool = False) -> Charge:
        return Charge.worst_case((budget,), num_prompt_tokens=tokens, max_tokens=tokens, batch=batch)

    line = await limiter.admit("acme", plan, 400, "line0", worst(200, batch=True))
    assert line.admitted and line.lease is not None
    assert (await limiter.admit("acme", plan, 400, "i1", worst(200))).admitted
    refused = await limiter.admit("acme", plan, 400, "i2", worst(200))  # 800 held of 1000
    assert refused.reason is Reason.BUDGET
    assert [(s.used, s.reserved) for s in await limiter.budgets("acme", (budget,))] == [(0, 800)]
    assert await limiter.settle(line.lease, 200, 100)  # the line pays 300 of the same budget
    assert [(s.used, s.reserved) for s in await limiter.budgets("acme", (budget,))] == [(300, 400)]
    assert (await limiter.admit("acme", plan, 300, "line1", worst(150, batch=True))).admitted
    assert (await limiter.admit("acme", plan, 2, "i3", worst(1))).reason is Reason.BUDGET  # 1000 of 1000
    clock.advance(6.0)  # every lease lapsed (the line's gateway died): an interactive admit prunes both
    assert (await limiter.admit("acme", plan, 500, "i4", worst(250))).admitted
    assert [(s.used, s.reserved) for s in await limiter.budgets("acme", (budget,))] == [(300, 500)]
