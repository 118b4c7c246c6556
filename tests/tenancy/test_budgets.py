"""Budgets and the ledger, one table of cases run against MemoryLimiter and RedisLimiter (real
redis-server), both on a hand-moved clock: windows reset at the UTC boundary with no sleeps."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest

from tenancy.billing import Budget, Charge, Price, window_bounds, window_index
from tenancy.bucket import Reason
from tenancy.keyspace import ledger_hours_key, ledger_prefix, open_async
from tenancy.ledger import HOUR_S, LedgerRow, MemoryStore, buckets
from tenancy.limiter import Limiter, MemoryLimiter
from tenancy.redis_limiter import RedisLimiter
from tenancy.scripts import PRELUDE
from tests.tenancy.conftest import FakeClock, MakeLimiter, make_plan

PLAN = make_plan(tokens_per_minute=1_000_000, requests_per_minute=10_000, max_concurrent_requests=1000)
PRICE = Price(input=100_000, cached_input=50_000, output=400_000)  # $0.10 / $0.05 / $0.40 per 1M
USD_5 = Budget("usd", 5_000_000, "monthly", source="plan free")


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


def charge(budgets: tuple[Budget, ...], prompt: int, max_tokens: int, key_id: str = "key_a") -> Charge:
    return Charge.worst_case(
        budgets, num_prompt_tokens=prompt, max_tokens=max_tokens, model="m", key_id=key_id, price=PRICE
    )


async def admit(limiter: Limiter, request_id: str, c: Charge, tenant: str = "acme"):  # type: ignore[no-untyped-def]
    return await limiter.admit(tenant, PLAN, 1, request_id, c)


def test_cost_is_integer_micro_dollars_rounded_up_per_request() -> None:
    assert PRICE.cost(1_000_000, 0, 1_000_000) == 500_000  # $0.10 + $0.40
    assert PRICE.cost(1000, 400, 10) == 60 + 20 + 4  # 600 uncached, 400 cached, 10 out
    assert PRICE.cost(1, 0, 0) == 1  # 0.1 micro-dollar rounds up
    assert PRICE.cost(0, 0, 0) == 0
    half = Price(100_000, 50_000, 400_000, batch_multiplier_ppm=500_000)
    assert half.cost(1_000_000, 0, 1_000_000, batch=True) == 250_000


@pytest.mark.parametrize(
    "when",
    [
        ts(2026, 12, 31, 23, 59, 59),
        ts(2027, 1, 1),
        ts(2024, 2, 29, 12),
        ts(2000, 3, 1),
        ts(1970, 1, 1),
        1000.0,
    ],
)
async def test_lua_windows_match_python(redis_url: str, when: float) -> None:
    client = open_async(redis_url)
    try:
        script = (
            PRELUDE + "return {window_index('d', tonumber(ARGV[1])), window_index('m', tonumber(ARGV[1]))}"
        )
        daily, monthly = await client.eval(script, 0, repr(when))
    finally:
        await client.aclose()
    assert (daily, monthly) == (window_index("daily", when), window_index("monthly", when))
    start, end = window_bounds("monthly", monthly)
    assert start is not None and end is not None and start <= when < end
    assert dt.datetime.fromtimestamp(start, dt.UTC).day == 1


async def test_a_hard_budget_reserves_the_worst_case_and_refuses_with_its_reset(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    clock.t = ts(2026, 12, 15, 10)
    limiter = make_limiter()
    budget = Budget("usd", 1000, "monthly", source="plan free")  # $0.001
    # Worst case of 1,000 prompt + 1,000 output tokens: 100 + 400 = 500 micro-dollars.
    first = await admit(limiter, "r1", charge((budget,), 1000, 1000))
    second = await admit(limiter, "r2", charge((budget,), 1000, 1000))
    assert first.admitted and second.admitted
    refused = await admit(limiter, "r3", charge((budget,), 1, 0))
    assert (refused.admitted, refused.reason) == (False, Reason.BUDGET)
    assert refused.budget is not None and (refused.budget.used, refused.budget.reserved) == (0, 1000)
    assert refused.headers().get("x-should-retry") == "false" and "retry-after" not in refused.headers()
    message = refused.message()
    assert "monthly spend budget of $0.001" in message and "plan free" in message
    assert "2027-01-01T00:00:00Z" in message
    # Settled at the real cost (100 prompt + 10 output tokens: 10 + 4 micro-dollars), the rest returns.
    assert first.lease is not None and second.lease is not None
    await limiter.settle(first.lease, 100, 10)
    await limiter.settle(second.lease, 100, 10)
    states = await limiter.budgets("acme", (budget,))
    assert (states[0].used, states[0].reserved) == (28, 0)
    assert (await admit(limiter, "r4", charge((budget,), 1000, 1000))).admitted


async def test_a_token_budget_counts_input_and_output(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    budget = Budget("tokens", 100, "none")
    decision = await admit(limiter, "r1", charge((budget,), 30, 70))
    assert decision.admitted and decision.lease is not None
    assert (await admit(limiter, "r2", charge((budget,), 1, 0))).reason is Reason.BUDGET
    await limiter.settle(decision.lease, 30, 20, cached_tokens=10)  # cached tokens are input tokens
    assert (await limiter.budgets("acme", (budget,)))[0].used == 50
    assert (await admit(limiter, "r3", charge((budget,), 25, 25))).admitted
    refused = await admit(limiter, "r4", charge((budget,), 1, 0))
    assert refused.reason is Reason.BUDGET and "It does not reset." in refused.message()


async def test_windows_reset_at_the_utc_boundary(make_limiter: MakeLimiter, clock: FakeClock) -> None:
    clock.t = ts(2026, 12, 31, 23, 59, 59)
    limiter = make_limiter()
    daily = Budget("tokens", 100, "daily")
    monthly = Budget("usd", 100, "monthly")  # 1,000 input tokens at $0.10 per 1M fill it
    for request_id, budget, prompt in (("d", daily, 100), ("m", monthly, 1000)):
        decision = await admit(limiter, request_id, charge((budget,), prompt, 0))
        assert decision.lease is not None
        await limiter.settle(decision.lease, prompt, 0)
    assert (await admit(limiter, "late-d", charge((daily,), 1, 0))).reason is Reason.BUDGET
    assert (await admit(limiter, "late-m", charge((monthly,), 10, 0))).reason is Reason.BUDGET
    clock.advance(1.0)  # 2027-01-01T00:00:00Z: a new day and a new month
    assert (await admit(limiter, "new-d", charge((daily,), 100, 0))).admitted
    assert (await admit(limiter, "new-m", charge((monthly,), 1000, 0))).admitted


async def test_a_request_admitted_before_the_reset_is_not_charged_to_the_new_window(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    clock.t = ts(2026, 12, 1, 23, 59, 50)
    limiter = make_limiter(lease_ttl_s=600.0)
    budget = Budget("tokens", 100, "daily")
    decision = await admit(limiter, "r1", charge((budget,), 50, 50))
    assert decision.lease is not None
    clock.advance(20)  # the stream ends after midnight
    await limiter.settle(decision.lease, 50, 50)
    states = await limiter.budgets("acme", (budget,))
    assert (states[0].used, states[0].reserved) == (0, 0)
    rows = await limiter.ledger(["acme"], 0, 10**7)  # the ledger has it all the same
    assert sum(r.input + r.output for r in rows) == 100


async def test_a_crashed_holder_leaves_no_phantom_reservation(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    limiter = make_limiter(lease_ttl_s=30.0)
    budget = Budget("tokens", 100, "none")
    held = await admit(limiter, "r1", charge((budget,), 50, 50))
    assert held.admitted  # ... and its gateway dies: never settled, never renewed
    assert (await admit(limiter, "r2", charge((budget,), 1, 0))).reason is Reason.BUDGET
    clock.advance(31)
    assert (await limiter.budgets("acme", (budget,)))[0].reserved == 0  # the expired hold counts for nothing
    decision = await admit(limiter, "r3", charge((budget,), 50, 50))
    assert decision.admitted
    assert (await limiter.budgets("acme", (budget,)))[0].reserved == 100  # only r3's hold


async def test_concurrent_admissions_never_overshoot_a_budget(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    budget = Budget("usd", 5_000, "monthly")  # 10 requests of 500 micro-dollars worst case
    decisions = await asyncio.gather(
        *(admit(limiter, f"r{i}", charge((budget,), 1000, 1000)) for i in range(100))
    )
    admitted = [d for d in decisions if d.admitted]
    assert len(admitted) == 10
    assert all(d.reason is Reason.BUDGET for d in decisions if not d.admitted)


async def test_settlement_is_idempotent_and_fills_the_ledger(
    make_limiter: MakeLimiter, clock: FakeClock
) -> None:
    clock.t = ts(2026, 12, 1, 10, 30)
    limiter = make_limiter()
    budget = Budget("usd", 10**9, "monthly")
    hour = int(clock.t // HOUR_S)
    for i, (model_key, prompt, cached, out) in enumerate([("key_a", 100, 40, 10), ("key_b", 200, 0, 20)]):
        decision = await admit(limiter, f"r{i}", charge((budget,), prompt, 100, key_id=model_key))
        assert decision.lease is not None
        assert await limiter.settle(decision.lease, prompt, out, cached_tokens=cached)
        assert not await limiter.settle(decision.lease, prompt, out, cached_tokens=cached)  # a repeat
    rows = await limiter.ledger(["acme"], hour, hour + 1)
    assert rows == [
        LedgerRow("acme", hour, "m", "key_a", False, 1, 100, 40, 10, PRICE.cost(100, 40, 10)),
        LedgerRow("acme", hour, "m", "key_b", False, 1, 200, 0, 20, PRICE.cost(200, 0, 20)),
    ]
    assert (await limiter.budgets("acme", (budget,)))[0].used == sum(r.cost for r in rows)
    usage = (await limiter.usage())["acme"]
    assert (usage.num_requests, usage.prompt_tokens) == (2, 300)


async def test_the_soft_threshold_fires_once_per_window(make_limiter: MakeLimiter, clock: FakeClock) -> None:
    clock.t = ts(2026, 12, 1, 12)
    limiter = make_limiter()
    crossed: list[tuple[str, str]] = []
    limiter.on_soft_limit = lambda tenant, budget: crossed.append((tenant, budget.metric))
    budget = Budget("tokens", 100, "daily", soft_ratio=0.5)
    for i in range(4):
        decision = await admit(limiter, f"r{i}", charge((budget,), 10, 10))
        assert decision.lease is not None
        await limiter.settle(decision.lease, 10, 10)  # 20, 40, 60 (crossed), 80
    assert crossed == [("acme", "tokens")]
    clock.advance(86400)
    for i in range(3):
        decision = await admit(limiter, f"n{i}", charge((budget,), 10, 10))
        assert decision.lease is not None
        await limiter.settle(decision.lease, 10, 10)
    assert crossed == [("acme", "tokens")] * 2


async def test_the_sqlite_store_keeps_budgets_and_the_ledger_across_a_restart(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "ledger.sqlite3"
    budget = Budget("tokens", 100, "none")
    first = MemoryLimiter(now=clock, store=MemoryStore(path))
    decision = await admit(first, "r1", charge((budget,), 30, 30))
    assert decision.lease is not None
    await first.settle(decision.lease, 30, 30)
    await first.aclose()
    second = MemoryLimiter(now=clock, store=MemoryStore(path))
    try:
        assert (await second.budgets("acme", (budget,)))[0].used == 60
        assert (await admit(second, "r2", charge((budget,), 30, 30))).reason is Reason.BUDGET
        assert [r.output for r in await second.ledger(["acme"], 0, 10**6)] == [30]
        assert not await second.settle(decision.lease, 30, 30)  # still a repeat after the restart
        assert (await second.budgets("acme", (budget,)))[0].used == 60
    finally:
        await second.aclose()


def test_buckets_have_openai_usage_shape() -> None:
    day = int(ts(2026, 12, 1))
    hour = day // HOUR_S
    rows = [
        LedgerRow("acme", hour, "m1", "key_a", False, 2, 10, 4, 5, 7),
        LedgerRow("acme", hour + 1, "m2", "key_a", False, 1, 3, 0, 2, 1),
        LedgerRow("globex", hour + 25, "m1", "key_b", False, 1, 1, 0, 1, 1),
    ]
    out = buckets(
        rows, start_time=day, end_time=day + 2 * 86400, bucket_width_s=86400, group_by=["project_id"]
    )
    assert [(b["object"], b["start_time"], b["end_time"]) for b in out] == [
        ("bucket", day, day + 86400),
        ("bucket", day + 86400, day + 2 * 86400),
    ]
    first = out[0]["results"]
    assert first == [
        {
            "object": "organization.usage.completions.result",
            "input_tokens": 13,
            "output_tokens": 7,
            "input_cached_tokens": 4,
            "num_model_requests": 3,
            "cost_micros": 8,
            "project_id": "acme",
            "user_id": None,
            "api_key_id": None,
            "model": None,
            "batch": None,
        }
    ]
    assert out[1]["results"][0]["project_id"] == "globex"
    hourly = buckets(rows, start_time=day, end_time=day + 7200, bucket_width_s=3600, group_by=["model"])
    assert [[r["model"] for r in b["results"]] for b in hourly] == [["m1"], ["m2"]]


async def test_settlement_names_the_hour_redis_is_in_when_the_gateways_clock_is_off(redis_url: str) -> None:
    """The settle script declares the ledger's hourly hash in KEYS (Redis Cluster routes on them);
    named from a clock an hour off, the script writes nothing, answers its hour, and the retry
    lands the row once in the hour by Redis's own clock."""
    from tenancy.redis_limiter import RedisLimiter

    limiter = RedisLimiter(open_async(redis_url))  # Redis's clock: no override
    try:
        budget = Budget("tokens", 10**9, "none")
        decision = await admit(limiter, "skewed", charge((budget,), 10, 10), tenant="skew")
        assert decision.lease is not None
        limiter._skew_s -= 3 * HOUR_S  # the gateway believes it is three hours earlier
        assert await limiter.settle(decision.lease, 10, 5)
        seconds, _ = await limiter.client.time()
        hour = int(seconds // HOUR_S)
        rows = await limiter.ledger(["skew"], hour - 5, hour + 1)
        assert [(r.hour, r.requests, r.input, r.output) for r in rows] == [(hour, 1, 10, 5)]
        assert (await limiter.budgets("skew", (budget,)))[0].used == 15
    finally:
        await limiter.aclose()


async def test_the_store_sums_what_the_rows_sum(make_limiter: MakeLimiter, clock: FakeClock) -> None:
    """The usage endpoints read sums made by the store (a Lua script in Redis, a GROUP BY in
    SQLite); they equal the rows summed in Python for every width, grouping and filter."""
    from tenancy.ledger import LedgerQuery, page

    clock.t = ts(2026, 12, 1, 22, 30)
    limiter = make_limiter()
    budget = Budget("usd", 10**12, "monthly")
    n = 0
    for step, (tenant, model, key_id) in enumerate(
        [("acme", "m1", "key_a"), ("acme", "m2", "key_b"), ("globex", "m1", "key_a"), ("acme", "m1", "key_a")]
        * 3
    ):
        n += 1
        c = Charge.worst_case(
            (budget,), num_prompt_tokens=10 + step, max_tokens=5, model=model, key_id=key_id, price=PRICE
        )
        decision = await admit(limiter, f"s{n}", c, tenant)
        assert decision.lease is not None
        await limiter.settle(decision.lease, 10 + step, step, cached_tokens=step % 3)
        clock.advance(1800)  # half an hour: the rows span three days' boundaries and six hours
    start, end = int(ts(2026, 12, 1)), int(ts(2026, 12, 3))
    rows = await limiter.ledger(["acme", "globex"], 0, 10**7)
    cases = [
        (3600, ()),
        (3600, ("model",)),
        (86400, ("project_id", "api_key_id")),
        (86400, ("batch", "model")),
    ]
    for width, group_by in cases:
        for models, key_ids in ((frozenset(), frozenset()), (frozenset({"m1"}), frozenset({"key_a"}))):
            first = start - start % width
            query = LedgerQuery(first // 3600, -(-end // 3600), width // 3600, group_by, models, key_ids)
            sums = await limiter.usage_sums(["acme", "globex"], query)
            kept = [
                r for r in rows if (not models or r.model in models) and (not key_ids or r.key_id in key_ids)
            ]
            expected = buckets(kept, start_time=start, end_time=end, bucket_width_s=width, group_by=group_by)
            got = page(sums, start_time=start, end_time=end, bucket_width_s=width, group_by=group_by)
            assert got == expected and any(b["results"] for b in got), (width, group_by, models)


async def test_each_ledger_hour_keeps_its_expiry_and_its_place_in_the_hours_index(
    redis_url: str, clock: FakeClock
) -> None:
    # Set by the first settlement of a group in the hour, kept by the later ones; old hours
    # leave the index after the retention.
    clock.t = ts(2026, 12, 1, 10, 30)
    limiter = RedisLimiter(open_async(redis_url), clock=clock, retention_s=2 * HOUR_S)
    client = limiter.client
    budget = Budget("usd", 10**9, "monthly")
    first_hour = int(clock.t // HOUR_S)
    first_seen: dict[int, float] = {}
    try:
        for i in range(8):  # two groups (keys) an hour, over four hours
            for key_id in ("key_a", "key_b"):
                decision = await admit(limiter, f"r{i}{key_id}", charge((budget,), 10, 10, key_id=key_id))
                assert decision.lease is not None
                assert await limiter.settle(decision.lease, 10, 5)
            hour = int(clock.t // HOUR_S)
            ttl = await client.ttl(ledger_prefix("acme") + str(hour))
            # The fake clock moves and Redis's does not: the TTL is the one the hour's first set.
            end_of_hour = (hour + 1) * HOUR_S - first_seen.setdefault(hour, clock.t)
            assert end_of_hour + 2 * HOUR_S - 2 <= ttl <= end_of_hour + 2 * HOUR_S, (i, ttl)
            clock.advance(HOUR_S / 2)
        last_hour = int((clock.t - 1) // HOUR_S)
        indexed = [int(h) for h in await client.zrange(ledger_hours_key("acme"), 0, -1)]
        assert indexed == list(range(last_hour - 3, last_hour + 1))  # the hour, 2 h retention and 1 h slack
        rows = await limiter.ledger(["acme"], first_hour, last_hour + 1)
        assert sum(r.requests for r in rows) == 14  # hour 10 (2 requests) is past the retention
        assert {r.key_id for r in rows} == {"key_a", "key_b"}
    finally:
        await limiter.aclose()
