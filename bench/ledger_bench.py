"""The usage ledger's two figures (issue 24): a 30-day hourly usage query, and what settlement
adds to a request.

    python -m bench.ledger_bench                       # both, Redis and SQLite
    python -m bench.ledger_bench --tenants 100         # a quick run

1. **Query.** The ledger is filled with `--tenants` tenants x `--models` models x `--days` days of
   hourly rows (one key each), in the layout settlement writes (Redis: one hash per tenant and
   hour plus the hours index; SQLite: the `ledger` table in the storage directory's file). Then
   `GET /v1/usage?bucket_width=1h&group_by=model` over the last 30 days for one tenant, through a
   real gateway (uvicorn on loopback, the tenant's own key): median and p95 of `--queries`
   calls, and the ledger read alone (the store's sums by hour and model for that tenant and window).
2. **Settlement.** Per request, in one run and in interleaved rounds, against a real
   redis-server and the SQLite store, with a money budget and the ledger: admit alone
   ("settlement off"; the lease is then dropped untimed, so holds do not pile up) against admit
   then what a request's answer waits for since issue 24's last change: the settlement sent
   (`settle_nowait`: queued on the connection that carries admissions, in order, its reply not
   waited for), back to back, so each admission queues behind the settlement before it (the
   worst case for a sequential client); and against admit then the whole settlement round trip
   (`settle`, what every request waited for before). The differences of the medians are
   settlement's added cost (`settlement_added_ms`) and the round trip's
   (`round_trip_added_ms`); `send_ms` is the median time of `settle_nowait` alone. Then
   settlement alone at each `--settle-concurrency` (requests in flight at once): a round's
   admissions first, untimed, then its settlements, timed together; their wall time per request
   is what settling costs the gateway and Redis per request at that load (on Redis, with the
   settle script's own time in Redis from INFO commandstats: the part no client change removes).

Prints a JSON summary (`--out` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import redis as redis_client

from tenancy.billing import Budget, Charge, Price
from tenancy.config import Plan
from tenancy.keys import hash_key
from tenancy.keyspace import held_key, leases_key, ledger_hours_key, ledger_prefix, open_async
from tenancy.ledger import (
    COUNTERS,
    HOUR_S,
    LEDGER_FILE,
    LedgerQuery,
    MemoryStore,
    field_prefix,
    read_redis_sums,
)
from tenancy.limiter import MemoryLimiter
from tenancy.redis_limiter import RedisLimiter
from tests.conftest_redis import RedisProcess

PRICE = Price(input=1_000_000, cached_input=500_000, output=4_000_000)


def _tenants_toml(num_tenants: int, models: list[str]) -> str:
    prices = "".join(f'[prices."{m}"]\ninput = 1.0\ncached_input = 0.5\noutput = 4.0\n\n' for m in models)
    plan = (
        '[plans.paid]\npriority = "paid"\ntokens_per_minute = 100000000\nrequests_per_minute = 1000000\n'
        "max_concurrent_requests = 1000\nqueue_deadline_seconds = 30\n\n"
    )
    tenants = "".join(
        f'[tenants.t{i}]\nplan = "paid"\nkeys = ["{hash_key(f"sk-bench-{i}")}"]\n'
        'budget_usd = 1000.0\nbudget_window = "monthly"\n\n'
        for i in range(num_tenants)
    )
    return prices + plan + tenants


def _row_values(tenant: int, hour: int, model: int) -> tuple[int, int, int, int, int]:
    requests = 1 + (tenant + hour + model) % 7
    inp, out = 100 * requests, 20 * requests
    cached = inp // 4
    return requests, inp, cached, out, PRICE.cost(inp, cached, out)


def fill_redis(url: str, num_tenants: int, models: list[str], hours: range) -> None:
    client = redis_client.Redis.from_url(url, socket_timeout=120)  # pipelines of big hashes: no 0.5 s cap
    try:
        pipe = client.pipeline(transaction=False)
        n = 0
        for t in range(num_tenants):
            tenant = f"t{t}"
            for hour in hours:
                mapping: dict[str, int] = {}
                for m, model in enumerate(models):
                    prefix = field_prefix(model, "key_bench", False)
                    for name, value in zip(COUNTERS, _row_values(t, hour, m), strict=True):
                        mapping[prefix + name] = value
                pipe.hset(ledger_prefix(tenant) + str(hour), mapping=mapping)  # type: ignore[arg-type]
                n += 1
                if n % 1000 == 0:
                    pipe.execute()
            pipe.zadd(ledger_hours_key(tenant), {str(h): h for h in hours})
        pipe.execute()
    finally:
        client.close()


def fill_sqlite(path: Path, num_tenants: int, models: list[str], hours: range) -> None:
    store = MemoryStore(path)
    db = store._db
    db.execute("BEGIN")
    for t in range(num_tenants):
        db.executemany(
            "INSERT INTO ledger VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (f"t{t}", hour, model, "key_bench", 0, *_row_values(t, hour, m))
                for hour in hours
                for m, model in enumerate(models)
            ],
        )
    db.execute("COMMIT")
    store.close()


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p95_ms": round(ordered[int(0.95 * (len(ordered) - 1))] * 1000, 2),
        "n": len(ordered),
    }


def query_bench(backend: str, work: Path, redis_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    from gateway.app import create_app
    from gateway.cli import build_tenancy
    from gateway.settings import Settings
    from tests.gateway.conftest import LiveServer
    from tests.gateway.fakes import FakeEngine

    models = [f"model-{m}" for m in range(args.models)]
    now = int(time.time())
    last_hour = now // HOUR_S
    hours = range(last_hour - args.days * 24 + 1, last_hour + 1)
    tenants = work / f"tenants-{backend}.toml"
    tenants.write_text(_tenants_toml(args.tenants, models))
    storage = work / f"storage-{backend}"
    started = time.monotonic()
    if redis_url is not None:
        fill_redis(redis_url, args.tenants, models, hours)
    else:
        fill_sqlite(storage / LEDGER_FILE, args.tenants, models, hours)
    fill_s = time.monotonic() - started
    settings = Settings(
        tenants=str(tenants),
        redis_url=redis_url,
        storage_dir=None if redis_url else str(storage),
        embedding_model="none",
    )
    tenancy = build_tenancy(settings)
    assert tenancy is not None
    live = LiveServer(create_app(settings, engine=FakeEngine(), tenancy=tenancy, owns_tenancy=True))
    tenant = f"t{args.tenants // 2}"
    params = {"bucket_width": "1h", "group_by": "model", "start_time": now - 30 * 86400, "end_time": now + 1}
    auth = {"authorization": f"Bearer sk-bench-{args.tenants // 2}"}
    http_times: list[float] = []
    read_times: list[float] = []
    try:
        with httpx.Client(base_url=live.base_url, headers=auth, timeout=60) as http:
            first = http.get("/v1/usage", params=params)
            assert first.status_code == 200, first.text
            body = first.json()
            num_results = sum(len(b["results"]) for b in body["data"])
            for _ in range(args.queries):
                t0 = time.perf_counter()
                r = http.get("/v1/usage", params=params)
                http_times.append(time.perf_counter() - t0)
                assert r.status_code == 200
    finally:
        live.stop()
    # The store's read alone, on a client of this loop (the server's is on its own).
    start_hour, end_hour = (now - 30 * 86400) // HOUR_S, last_hour + 1
    expected = len(models) * len(range(max(start_hour, hours.start), end_hour))
    query = LedgerQuery(start_hour, end_hour, 1, ("model",))  # what GET /v1/usage asks the store

    async def reads() -> None:
        if redis_url is not None:
            client = open_async(redis_url)
            try:
                for _ in range(args.queries):
                    t0 = time.perf_counter()
                    rows = await read_redis_sums(client, [tenant], query)
                    read_times.append(time.perf_counter() - t0)
                    assert len(rows) == expected, (len(rows), expected)
            finally:
                await client.aclose()
        else:
            store = MemoryStore(storage / LEDGER_FILE)
            try:
                for _ in range(args.queries):
                    t0 = time.perf_counter()
                    rows = store.sums([tenant], query)
                    read_times.append(time.perf_counter() - t0)
                    assert len(rows) == expected, (len(rows), expected)
            finally:
                store.close()

    asyncio.run(reads())
    return {
        "backend": backend,
        "data": f"{args.tenants} tenants x {args.models} models x {args.days * 24} hours",
        "fill_s": round(fill_s, 1),
        "buckets": len(body["data"]),
        "results": num_results,
        "http_get_v1_usage": _percentiles(http_times),
        "store_read": _percentiles(read_times),
    }


SETTLE_PLAN = Plan(
    name="paid",
    priority="paid",
    tokens_per_minute=10**12,
    requests_per_minute=10**12,
    max_concurrent_requests=10**9,
    queue_deadline_seconds=30,
)
SETTLE_BUDGET = Budget("usd", 10**15, "monthly", source="bench")


def charge() -> Charge:
    """A request's worst case against a money budget (what a budgeted request holds)."""
    return Charge.worst_case(
        (SETTLE_BUDGET,), num_prompt_tokens=100, max_tokens=50, model="m", key_id="key_bench", price=PRICE
    )


async def settle_bench(
    limiter: Any, rounds: int, requests: int, release: Callable[[Any], Awaitable[Any]]
) -> dict[str, Any]:
    """Per request, the medians of admit alone, admit + the settlement sent, and admit + the
    settlement's round trip; `release` drops an unsettled lease and its hold, untimed."""
    plan = SETTLE_PLAN
    times: dict[str, list[float]] = {"off": [], "sent": [], "round_trip": []}
    send: list[float] = []
    n = 0
    for _ in range(rounds):  # interleaved rounds: off, sent, round trip, off ...
        for mode, samples in times.items():
            for _ in range(requests):
                n += 1
                t0 = time.perf_counter()
                decision = await limiter.admit("bench", plan, 150, f"r{n}", charge())
                if mode == "sent":
                    t1 = time.perf_counter()
                    limiter.settle_nowait(decision.lease, 100, 20, cached_tokens=25)
                    send.append(time.perf_counter() - t1)
                elif mode == "round_trip":
                    assert await limiter.settle(decision.lease, 100, 20, cached_tokens=25)
                samples.append(time.perf_counter() - t0)
                assert decision.admitted
                if mode == "off":  # not timed: the hold must not pile up under the next admissions
                    await release(decision.lease)
            if mode == "sent":  # untimed: every settlement sent this round has landed
                await limiter.settled()
    off, sent, round_trip = (statistics.median(times[m]) * 1000 for m in ("off", "sent", "round_trip"))
    ordered = sorted(times["sent"])
    return {
        "requests_per_round": requests,
        "rounds": rounds,
        "admit_only_ms": round(off, 4),
        "admit_and_send_ms": round(sent, 4),
        "admit_and_send_p95_ms": round(ordered[int(0.95 * (len(ordered) - 1))] * 1000, 4),
        "settlement_added_ms": round(sent - off, 4),
        "send_ms": round(statistics.median(send) * 1000, 4),
        "admit_and_round_trip_ms": round(round_trip, 4),
        "round_trip_added_ms": round(round_trip - off, 4),
    }


async def settle_at(
    limiter: Any, rounds: int, requests: int, concurrency: int, redis_url: str | None = None
) -> dict[str, Any]:
    """Settlement alone with `concurrency` in flight: each round's admissions (untimed), then its
    settlements timed together; the median of their wall time per request. With `redis_url`, also
    the settle script's own time in Redis (INFO commandstats over the settlements only)."""
    slots = asyncio.Semaphore(concurrency)
    per_request: list[float] = []
    stats = redis_client.Redis.from_url(redis_url) if redis_url else None
    script_us = script_calls = 0.0

    async def admit(request_id: str) -> Any:
        async with slots:
            decision = await limiter.admit("bench", SETTLE_PLAN, 150, request_id, charge())
        assert decision.admitted
        return decision.lease

    async def settle(lease: Any) -> None:
        async with slots:
            assert await limiter.settle(lease, 100, 20, cached_tokens=25)

    for r in range(rounds):
        leases = await asyncio.gather(*(admit(f"c{concurrency}-{r}-{i}") for i in range(requests)))
        if stats is not None:
            stats.config_resetstat()
        t0 = time.perf_counter()
        await asyncio.gather(*(settle(lease) for lease in leases))
        per_request.append((time.perf_counter() - t0) / requests)
        if stats is not None:
            evalsha = stats.info("commandstats").get("cmdstat_evalsha", {})
            script_us += float(evalsha.get("usec", 0))
            script_calls += float(evalsha.get("calls", 0))
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "requests_per_round": requests,
        "rounds": rounds,
        "settle_ms_per_request": round(statistics.median(per_request) * 1000, 4),
    }
    if stats is not None:
        stats.close()
        out["redis_script_ms_per_settle"] = round(script_us / max(script_calls, 1) / 1000, 4)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--models", type=int, default=5)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--settle-rounds", type=int, default=6)
    parser.add_argument("--settle-requests", type=int, default=300)
    parser.add_argument(
        "--settle-concurrency", default="1,32", help="settlements in flight at once, comma-separated"
    )
    parser.add_argument("--skip", choices=("query", "settle"), action="append", default=[])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out: dict[str, Any] = {"query": [], "settle": {}}
    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        work = Path(tmp)
        redis = RedisProcess(work / "redis")
        redis.start()
        try:
            if "query" not in args.skip:
                for backend, url in (("redis", redis.url), ("sqlite", None)):
                    out["query"].append(query_bench(backend, work, url, args))
                    print(json.dumps(out["query"][-1]), flush=True)
            if "settle" not in args.skip:
                redis_client.Redis.from_url(redis.url, socket_timeout=300).flushall()

                async def both() -> None:
                    limiter = RedisLimiter(open_async(redis.url))

                    async def drop(lease: Any) -> None:
                        await limiter.client.delete(held_key("bench"), leases_key("bench"))

                    levels = [int(c) for c in args.settle_concurrency.split(",")]
                    try:
                        out["settle"]["redis"] = await settle_bench(
                            limiter, args.settle_rounds, args.settle_requests, drop
                        )
                        out["settle"]["redis"]["alone"] = [
                            await settle_at(limiter, args.settle_rounds, args.settle_requests, c, redis.url)
                            for c in levels
                        ]
                    finally:
                        await limiter.aclose()
                    memory = MemoryLimiter(store=MemoryStore(work / "settle" / LEDGER_FILE))

                    async def settle_untimed(lease: Any) -> None:
                        await memory.settle(lease, 0, 0)

                    try:
                        out["settle"]["sqlite"] = await settle_bench(
                            memory, args.settle_rounds, args.settle_requests, settle_untimed
                        )
                        out["settle"]["sqlite"]["alone"] = [
                            await settle_at(memory, args.settle_rounds, args.settle_requests, c)
                            for c in levels
                        ]
                    finally:
                        await memory.aclose()

                asyncio.run(both())
        finally:
            redis.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
