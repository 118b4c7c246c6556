"""Issue 24: the 30-day hourly usage read of one tenant (5 models), the old path (rows, then
sums in Python) against the new (sums by the store), interleaved in one run, on Redis and
SQLite; asserts both give the same page.

PYTHONPATH=. python bench/ledger_ab.py
"""

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from bench.ledger_bench import fill_redis, fill_sqlite
from tenancy.keyspace import ledger_hours_key, ledger_prefix, open_async
from tenancy.ledger import LedgerQuery, MemoryStore, buckets, page, read_redis_sums, rows_of_hash
from tests.conftest_redis import RedisProcess

now_s = int(time.time())
now = now_s // 3600
start_s = now_s - 30 * 86400
q = LedgerQuery(start_s // 3600, now + 1, 1, ("model",))


def pg_new(s):
    return orjson.dumps(
        page(s, start_time=start_s, end_time=now_s + 1, bucket_width_s=3600, group_by=["model"])
    )


def pg_old(rows):
    return orjson.dumps(
        buckets(rows, start_time=start_s, end_time=now_s + 1, bucket_width_s=3600, group_by=["model"])
    )


async def old_redis(c):
    hours = await c.zrangebyscore(ledger_hours_key("t0"), q.start_hour, f"({q.end_hour}")
    pipe = c.pipeline(transaction=False)
    for h in hours:
        pipe.hgetall(ledger_prefix("t0") + h)
    rows = []
    for h, f in zip(hours, await pipe.execute(), strict=False):
        rows.extend(rows_of_hash("t0", int(h), f))
    return pg_old(rows)


async def new_redis(c):
    return pg_new(await read_redis_sums(c, ["t0"], q))


def med(x):
    return round(statistics.median(x) * 1000, 1)


async def main(url, store):
    c = open_async(url, operation_timeout_s=10)
    t = {"redis_old": [], "redis_new": [], "sqlite_old": [], "sqlite_new": []}
    for _i in range(25):
        for name, fn in (("redis_old", lambda: old_redis(c)), ("redis_new", lambda: new_redis(c))):
            t0 = time.perf_counter()
            await fn()
            t[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a = pg_old(store.ledger(["t0"], q.start_hour, q.end_hour))
        t["sqlite_old"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = pg_new(store.sums(["t0"], q))
        t["sqlite_new"].append(time.perf_counter() - t0)
        assert a == b
    assert await old_redis(c) == await new_redis(c)
    print({k: med(v) for k, v in t.items()})
    info = await c.info("commandstats")
    print({k: v["usec_per_call"] for k, v in info.items() if k in ("cmdstat_evalsha", "cmdstat_hgetall")})
    await c.aclose()


with tempfile.TemporaryDirectory() as tmp:
    r = RedisProcess(Path(tmp) / "r")
    r.start()
    try:
        models = [f"model-{m}" for m in range(5)]
        hours = range(now - 719, now + 1)
        fill_redis(r.url, 1, models, hours)
        fill_sqlite(Path(tmp) / "l.sqlite3", 1, models, hours)
        store = MemoryStore(Path(tmp) / "l.sqlite3")
        asyncio.run(main(r.url, store))
    finally:
        r.stop()
