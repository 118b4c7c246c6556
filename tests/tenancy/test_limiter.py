"""One table of limiter cases, run against MemoryLimiter and RedisLimiter (real redis-server).

Both backends read the same hand-moved clock (Redis through the scripts' clock override), so
refill, expiry and retry-after are checked exactly, with no sleeps.
"""

from __future__ import annotations

import random

import pytest

from tenancy.bucket import CONCURRENCY_RETRY_S, Reason
from tenancy.config import OPEN_PLAN
from tenancy.keyspace import open_async
from tenancy.limiter import Lease, MemoryLimiter
from tenancy.redis_limiter import RedisLimiter
from tenancy.usage import TenantUsage
from tests.tenancy.conftest import FakeClock, MakeLimiter, make_plan

PLAN = make_plan(tokens_per_minute=600, requests_per_minute=60, max_concurrent_requests=10)  # 10 tok/s


async def test_fresh_bucket_is_full_and_reports_openai_fields(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    decision = await limiter.admit("acme", PLAN, 100, "r1")
    assert decision.admitted and decision.reason is Reason.OK and decision.lease is not None
    assert (decision.limit_tokens, decision.limit_requests) == (600, 60)
    assert (decision.remaining_tokens, decision.remaining_requests) == (500, 59)
    assert decision.reset_tokens_s == pytest.approx(10.0)  # 100 tokens at 10/s
    assert decision.reset_requests_s == pytest.approx(1.0)  # 1 request at 1/s
    assert decision.lease.reserved_tokens == 100


async def test_refill_is_continuous_and_retry_after_comes_from_the_bucket(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    limiter = make_limiter()
    assert (await limiter.admit("acme", PLAN, 600, "r1")).admitted
    refused = await limiter.admit("acme", PLAN, 50, "r2")
    assert (refused.admitted, refused.reason) == (False, Reason.TOKENS)
    assert refused.retry_after_s == pytest.approx(5.0)  # 50 tokens at 10/s
    assert refused.remaining_tokens == 0 and refused.lease is None
    clock.advance(2.5)
    half = await limiter.admit("acme", PLAN, 50, "r3")
    assert not half.admitted and half.retry_after_s == pytest.approx(2.5)
    assert half.remaining_tokens == 25
    clock.advance(2.5)
    admitted = await limiter.admit("acme", PLAN, 50, "r4")
    assert admitted.admitted and admitted.remaining_tokens == 0


async def test_refill_is_capped_at_capacity(make_limiter: MakeLimiter, clock: FakeClock) -> None:
    limiter = make_limiter()
    assert (await limiter.admit("acme", PLAN, 600, "r1")).admitted
    clock.advance(3600)
    decision = await limiter.admit("acme", PLAN, 100, "r2")
    assert decision.remaining_tokens == 500  # refilled to 600, not 36,000


async def test_reservation_above_capacity_is_refused_and_changes_nothing(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    refused = await limiter.admit("acme", PLAN, 601, "r1")
    assert (refused.admitted, refused.reason, refused.retry_after_s) == (False, Reason.TOO_LARGE, 0.0)
    assert "Request too large" in refused.message()
    assert (await limiter.admit("acme", PLAN, 600, "r2")).admitted  # bucket untouched


async def test_request_bucket_limits_requests(make_limiter: MakeLimiter, clock: FakeClock) -> None:
    limiter = make_limiter()
    plan = make_plan(tokens_per_minute=6000, requests_per_minute=2, max_concurrent_requests=10)
    assert (await limiter.admit("acme", plan, 1, "r1")).admitted
    assert (await limiter.admit("acme", plan, 1, "r2")).admitted
    refused = await limiter.admit("acme", plan, 1, "r3")
    assert refused.reason is Reason.REQUESTS and refused.retry_after_s == pytest.approx(30.0)
    assert refused.remaining_requests == 0 and refused.reset_requests_s == pytest.approx(60.0)
    clock.advance(30)
    assert (await limiter.admit("acme", plan, 1, "r4")).admitted


async def test_concurrency_limit_one_refuses_a_second_lease(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    plan = make_plan(max_concurrent_requests=1)
    first = await limiter.admit("acme", plan, 10, "r1")
    assert first.admitted and first.lease is not None
    second = await limiter.admit("acme", plan, 10, "r2")
    assert (second.admitted, second.reason, second.retry_after_s) == (
        False,
        Reason.CONCURRENCY,
        CONCURRENCY_RETRY_S,
    )
    # All or nothing: the refused request took no tokens and no request.
    assert second.remaining_tokens == 590 and second.remaining_requests == 599
    assert await limiter.settle(first.lease, 5, 5)
    assert (await limiter.admit("acme", plan, 10, "r3")).admitted


async def test_short_completion_refund_makes_room_for_the_next_request(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    first = await limiter.admit("acme", PLAN, 500, "r1")  # prompt 100 + max_tokens 400
    assert first.lease is not None
    assert not (await limiter.admit("acme", PLAN, 300, "r2")).admitted  # 100 left
    assert await limiter.settle(first.lease, prompt_tokens=100, completion_tokens=20)  # 380 back
    after = await limiter.admit("acme", PLAN, 300, "r3")
    assert after.admitted and after.remaining_tokens == 180


async def test_refund_never_exceeds_capacity(make_limiter: MakeLimiter, clock: FakeClock) -> None:
    limiter = make_limiter()
    first = await limiter.admit("acme", PLAN, 300, "r1")
    assert first.lease is not None
    clock.advance(40)  # refilled to full while the request ran
    assert await limiter.settle(first.lease, 0, 0)
    assert (await limiter.admit("acme", PLAN, 600, "r2")).remaining_tokens == 0  # 600, not 900


async def test_overuse_is_not_refunded_and_takes_nothing_extra(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    first = await limiter.admit("acme", PLAN, 100, "r1")
    assert first.lease is not None
    await limiter.settle(first.lease, 90, 50)  # more than reserved (tokenizer mismatch)
    assert (await limiter.admit("acme", PLAN, 1, "r2")).remaining_tokens == 499


async def test_lease_expires_after_its_ttl_when_never_settled(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    limiter = make_limiter(lease_ttl_s=1.0)
    plan = make_plan(max_concurrent_requests=1)
    held = await limiter.admit("acme", plan, 10, "crashed")
    assert held.lease is not None and held.lease.expires_at == pytest.approx(clock() + 1.0)
    clock.advance(0.99)
    assert (await limiter.admit("acme", plan, 10, "r2")).reason is Reason.CONCURRENCY
    clock.advance(0.02)
    assert (await limiter.admit("acme", plan, 10, "r3")).admitted
    # The late settle of an expired lease refunds nothing but still counts usage.
    assert not await limiter.settle(held.lease, 1, 1)
    assert (await limiter.usage())["acme"] == TenantUsage(1, 1, 1)


async def test_renew_keeps_a_lease_alive_and_fails_once_it_is_gone(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    limiter = make_limiter(lease_ttl_s=1.0)
    plan = make_plan(max_concurrent_requests=1)
    held = await limiter.admit("acme", plan, 10, "long-stream")
    assert held.lease is not None
    for _ in range(5):
        clock.advance(0.6)
        assert await limiter.renew(held.lease)
    assert (await limiter.admit("acme", plan, 10, "r2")).reason is Reason.CONCURRENCY
    assert await limiter.settle(held.lease, 1, 1)
    assert not await limiter.renew(held.lease)  # settled
    expired = (await limiter.admit("acme", plan, 10, "r3")).lease
    assert expired is not None
    clock.advance(1.5)
    assert not await limiter.renew(expired)  # expired: renewing would resurrect it


async def test_tenants_are_independent(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    assert (await limiter.admit("acme", PLAN, 600, "r1")).admitted
    assert (await limiter.admit("globex", PLAN, 600, "r2")).admitted


async def test_usage_counts_prompt_and_completion_tokens(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    for prompt, completion in [(10, 5), (20, 7)]:
        lease = (await limiter.admit("acme", PLAN, prompt + 50, f"r{prompt}")).lease
        assert lease is not None
        await limiter.settle(lease, prompt, completion)
    assert (await limiter.usage())["acme"] == TenantUsage(
        prompt_tokens=30, completion_tokens=12, num_requests=2
    )


async def test_unlimited_plan_admits_without_state(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    for index in range(50):
        decision = await limiter.admit("default", OPEN_PLAN, 10**9, f"r{index}")
        assert decision.admitted and decision.headers() == {}
        assert decision.lease is not None and not decision.lease.tracked
        assert await limiter.renew(decision.lease)
        lease = decision.lease
    await limiter.settle(lease, 3, 4)
    assert (await limiter.usage())["default"] == TenantUsage(3, 4, 1)


async def test_backends_agree_on_random_traffic(redis_url: str) -> None:
    """Differential check that the Lua scripts mirror tenancy.bucket: the same random mix of
    admits, settles, renewals and clock steps gives the same decisions from both backends."""
    rng = random.Random(20240607)
    clock = FakeClock()
    memory = MemoryLimiter(now=clock, lease_ttl_s=5.0)
    redis_limiter = RedisLimiter(open_async(redis_url), clock=clock, lease_ttl_s=5.0)
    plans = [
        make_plan(tokens_per_minute=900, requests_per_minute=30, max_concurrent_requests=3),
        make_plan(tokens_per_minute=397, requests_per_minute=3, max_concurrent_requests=2),
    ]
    held: list[tuple[Lease, Lease]] = []
    try:
        for index in range(400):
            op = rng.random()
            if op < 0.55:
                tenant = rng.choice(["a", "b"])
                plan = plans[tenant == "b"]
                tokens = rng.randint(0, 120 if tenant == "a" else 420)
                pair = [await lim.admit(tenant, plan, tokens, f"r{index}") for lim in (memory, redis_limiter)]
                fields = [
                    (d.admitted, d.reason, d.remaining_tokens, d.remaining_requests, d.limit_tokens)
                    for d in pair
                ]
                assert fields[0] == fields[1], (index, fields)
                for name in ("retry_after_s", "reset_tokens_s", "reset_requests_s"):
                    assert getattr(pair[0], name) == pytest.approx(getattr(pair[1], name), rel=1e-9, abs=1e-9)
                if pair[0].lease and pair[1].lease:
                    held.append((pair[0].lease, pair[1].lease))
            elif op < 0.75 and held:
                mem_lease, redis_lease = held.pop(rng.randrange(len(held)))
                prompt, completion = rng.randint(0, 60), rng.randint(0, 60)
                assert await memory.settle(mem_lease, prompt, completion) == await redis_limiter.settle(
                    redis_lease, prompt, completion
                )
            elif op < 0.85 and held:
                mem_lease, redis_lease = rng.choice(held)
                assert await memory.renew(mem_lease) == await redis_limiter.renew(redis_lease)
            else:
                clock.advance(rng.choice([0.05, 0.5, 2.0, 7.0]))
        assert await memory.usage() == await redis_limiter.usage()
    finally:
        await redis_limiter.aclose()
