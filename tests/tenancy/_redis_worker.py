"""A separate OS process for the cross-process tests: ``python -m tests.tenancy._redis_worker``.

``admit URL TENANT N TOKENS TPM``: N concurrent admits; prints how many were admitted.
``hold URL TENANT TTL NOW``: takes one lease (concurrency 1) at clock NOW with lease TTL, prints
``held``, then hangs until killed, never settling.
"""

from __future__ import annotations

import asyncio
import sys

from tenancy.config import Plan
from tenancy.redis_limiter import RedisLimiter


def plan(tokens_per_minute: int, max_concurrent_requests: int) -> Plan:
    return Plan("test", "paid", tokens_per_minute, 100_000, max_concurrent_requests, 5.0)


async def admit(url: str, tenant: str, n: int, tokens: int, tokens_per_minute: int) -> None:
    limiter = RedisLimiter.from_url(url)
    try:
        the_plan = plan(tokens_per_minute, 100_000)
        decisions = await asyncio.gather(
            *(limiter.admit(tenant, the_plan, tokens, f"w{index}") for index in range(n))
        )
        print(sum(d.admitted for d in decisions), flush=True)
    finally:
        await limiter.aclose()


async def hold(url: str, tenant: str, ttl: float, now: float) -> None:
    limiter = RedisLimiter.from_url(url, lease_ttl_s=ttl, clock=lambda: now)
    decision = await limiter.admit(tenant, plan(1000, 1), 10, "doomed")
    print("held" if decision.admitted else f"refused {decision.reason}", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    command, url, tenant, *rest = sys.argv[1:]
    if command == "admit":
        asyncio.run(admit(url, tenant, int(rest[0]), int(rest[1]), int(rest[2])))
    else:
        asyncio.run(hold(url, tenant, float(rest[0]), float(rest[1])))
