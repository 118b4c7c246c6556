"""The usage ledger: per-tenant, per-hour counters by model, API key and batch, and how to read them.

Settlement writes the ledger in the same atomic step as the refund and the budgets: in Redis
(``tenancy.scripts.SETTLE_SCRIPT``, one hash per tenant and hour) or, without Redis, in SQLite
(:class:`MemoryStore`: a file in the storage directory, so a restart keeps budgets and ledger,
or an in-memory database when there is no storage directory). A usage read is summed by the
store itself (:class:`LedgerQuery`: ``SUM_SCRIPT`` over a tenant's hourly hashes in Redis, one
GROUP BY in SQLite) and written as OpenAI's organization Usage API buckets by :func:`page`;
:func:`buckets` does the same from rows already read.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tenancy.keyspace import ledger_hours_key, ledger_prefix

HOUR_S = 3600
DAY_S = 86400
DEFAULT_RETENTION_S = 90 * DAY_S
LEDGER_FILE = "ledger.sqlite3"
COUNTERS = ("requests", "input", "cached", "output", "cost")
GROUPS = ("project_id", "model", "api_key_id", "batch")


@dataclass(frozen=True)
class LedgerRow:
    """One hour of one tenant's use of one model with one key (cost in micro-dollars)."""

    tenant: str
    hour: int  # hours since the epoch (UTC)
    model: str
    key_id: str
    batch: bool
    requests: int = 0
    input: int = 0  # cached included
    cached: int = 0
    output: int = 0
    cost: int = 0

    def plus(self, other: LedgerRow) -> LedgerRow:
        return replace(
            self,
            requests=self.requests + other.requests,
            input=self.input + other.input,
            cached=self.cached + other.cached,
            output=self.output + other.output,
            cost=self.cost + other.cost,
        )


@dataclass(frozen=True)
class BudgetUpdate:
    """Charge ``amount`` to budget ``key`` in ``window``; report when ``soft`` is crossed."""

    key: str
    window: int
    amount: int
    soft: int | None = None


def field_prefix(model: str, key_id: str, batch: bool) -> str:
    """The ledger hash's field prefix (tabs cannot appear in the parts; they are replaced)."""
    return f"{model.replace(chr(9), ' ')}\t{key_id}\t{1 if batch else 0}\t"


_COUNTER_INDEX = {name: i for i, name in enumerate(COUNTERS)} | {
    name.encode(): i for i, name in enumerate(COUNTERS)
}


def rows_of_hash(tenant: str, hour: int, fields: Mapping[Any, Any]) -> list[LedgerRow]:
    """The rows stored in one Redis ledger hash (field names as bytes or str). A 30-day read
    parses thousands of fields: each prefix (model, key, batch) is decoded once, not per field."""
    found: dict[Any, list[int]] = {}
    for name, value in fields.items():
        prefix, _, counter = name.rpartition(b"\t" if isinstance(name, bytes) else "\t")
        index = _COUNTER_INDEX.get(counter)
        if index is not None:
            found.setdefault(prefix, [0] * len(COUNTERS))[index] = int(value)
    rows = []
    for prefix, counts in found.items():
        text = prefix.decode() if isinstance(prefix, bytes) else prefix
        model, key_id, batch = text.split("\t")
        rows.append(LedgerRow(tenant, hour, model, key_id, batch == "1", *counts))
    rows.sort(key=lambda r: (r.model, r.key_id, r.batch))
    return rows


@dataclass(frozen=True)
class LedgerQuery:
    """What a usage read sums: hours ``[start_hour, end_hour)``, in buckets of ``width_hours``
    from ``start_hour``, grouped by ``group_by`` (fields of :data:`GROUPS`), optionally only
    some models and API key ids."""

    start_hour: int
    end_hour: int
    width_hours: int = 1
    group_by: tuple[str, ...] = ()
    models: frozenset[str] = frozenset()
    key_ids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for group in self.group_by:
            if group not in GROUPS:
                raise ValueError(f"group_by: unknown field {group!r} (one of {', '.join(GROUPS)})")


# Summed counters (requests, input, cached, output, cost) by (bucket index, group values); the
# group values follow LedgerQuery.group_by: tenant, model, key id or None, batch as bool.
Sums = dict[tuple[int, tuple[Any, ...]], list[int]]


def add_sums(into: Sums, key: tuple[int, tuple[Any, ...]], counts: Sequence[int]) -> None:
    total = into.get(key)
    if total is None:
        into[key] = list(counts)
    else:
        for i, value in enumerate(counts):
            total[i] += value


def sum_rows(rows: Iterable[LedgerRow], query: LedgerQuery) -> Sums:
    """``rows`` summed as the stores sum them (for rows already read)."""
    sums: Sums = {}
    for row in rows:
        if not query.start_hour <= row.hour < query.end_hour:
            continue
        if (query.models and row.model not in query.models) or (
            query.key_ids and row.key_id not in query.key_ids
        ):
            continue
        key = (
            (row.hour - query.start_hour) // query.width_hours,
            tuple(_group_value(row, g) for g in query.group_by),
        )
        add_sums(sums, key, (row.requests, row.input, row.cached, row.output, row.cost))
    return sums


def rows_of_sums(sums: Sums, query: LedgerQuery) -> list[LedgerRow]:
    """Sums of a query grouped by every field at a width of one hour, as rows (sorted)."""
    assert query.group_by == GROUPS and query.width_hours == 1
    rows = [
        LedgerRow(tenant, query.start_hour + b, model, key_id or "", batch, *counts)
        for (b, (tenant, model, key_id, batch)), counts in sums.items()
    ]
    rows.sort(key=lambda r: (r.tenant, r.hour, r.model, r.key_id, r.batch))
    return rows


def _group_values(
    group_by: Sequence[str], tenant: str, model: str, key_id: str, batch: str
) -> tuple[Any, ...]:
    values = {"project_id": tenant, "model": model, "api_key_id": key_id or None, "batch": batch == "1"}
    return tuple(values[g] for g in group_by)


def _parse_sums(tenant: str, raw: Sequence[Any], query: LedgerQuery, into: Sums) -> None:
    """Add one tenant's reply of SUM_SCRIPT to ``into``."""
    num_groups = int(raw[0])
    groups = [
        _group_values(query.group_by, tenant, *(str(v) for v in raw[1 + 3 * g : 4 + 3 * g]))
        for g in range(num_groups)
    ]
    values = [int(v) for v in raw[1 + 3 * num_groups :]]
    for i in range(0, len(values), 7):
        key = (values[i], groups[values[i + 1] - 1])
        total = into.get(key)
        if total is None:
            into[key] = values[i + 2 : i + 7]
        else:
            for j, value in enumerate(values[i + 2 : i + 7]):
                total[j] += value


def sum_args(query: LedgerQuery, tenant: str) -> list[Any]:
    return [
        ledger_prefix(tenant),
        query.start_hour,
        query.width_hours,
        *(int(g in query.group_by) for g in ("model", "api_key_id", "batch")),
        len(query.models),
        *sorted(query.models),
        len(query.key_ids),
        *sorted(query.key_ids),
    ]


async def read_redis_sums(client: aioredis.Redis, tenants: Iterable[str], query: LedgerQuery) -> Sums:
    """``query`` over ``tenants``, summed by Redis: the hours index of each tenant first (one
    pipelined round trip), then one SUM_SCRIPT per tenant over its hourly hashes, which answers
    per-bucket, per-group totals (3,600 numbers for 30 days of 5 models by the hour, not the
    18,000 hash fields), so neither Python nor the wire handles the raw fields."""
    from tenancy.scripts import SUM_SCRIPT

    tenants = list(tenants)
    pipe = client.pipeline(transaction=False)
    for tenant in tenants:
        pipe.zrangebyscore(ledger_hours_key(tenant), query.start_hour, f"({query.end_hour}")
    wanted = [(t, hours) for t, hours in zip(tenants, await pipe.execute(), strict=True) if hours]
    script = client.register_script(SUM_SCRIPT)
    sums: Sums = {}
    if len(wanted) == 1:  # a tenant's own query: one call, no pipeline (whose script check costs a trip)
        tenant, hours = wanted[0]
        keys = [ledger_prefix(tenant) + str(h) for h in hours]
        _parse_sums(tenant, await script(keys=keys, args=sum_args(query, tenant)), query, sums)
        return sums
    for chunk in range(0, len(wanted), 100):
        part = wanted[chunk : chunk + 100]
        pipe = client.pipeline(transaction=False)
        for tenant, hours in part:
            await script(
                keys=[ledger_prefix(tenant) + str(h) for h in hours],
                args=sum_args(query, tenant),
                client=pipe,
            )
        for (tenant, _), raw in zip(part, await pipe.execute(), strict=True):
            _parse_sums(tenant, raw, query, sums)
    return sums


async def read_redis_ledger(
    client: aioredis.Redis, tenants: Iterable[str], start_hour: int, end_hour: int
) -> list[LedgerRow]:
    """Every row of ``tenants`` in ``[start_hour, end_hour)`` (the sums grouped by everything)."""
    query = LedgerQuery(start_hour, end_hour, 1, GROUPS)
    return rows_of_sums(await read_redis_sums(client, tenants, query), query)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (
  key TEXT PRIMARY KEY, window INTEGER NOT NULL, used INTEGER NOT NULL, soft INTEGER
);
CREATE TABLE IF NOT EXISTS ledger (
  tenant TEXT NOT NULL, hour INTEGER NOT NULL, model TEXT NOT NULL, key_id TEXT NOT NULL,
  batch INTEGER NOT NULL, requests INTEGER NOT NULL, input INTEGER NOT NULL,
  cached INTEGER NOT NULL, output INTEGER NOT NULL, cost INTEGER NOT NULL,
  PRIMARY KEY (tenant, hour, model, key_id, batch)
);
CREATE TABLE IF NOT EXISTS settled (request_id TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS settled_at ON settled (at);
"""


class MemoryStore:
    """Budgets' use, the ledger and settlement markers for the in-process limiter, in SQLite.

    ``path`` None: an in-memory database (lost on exit). Every method is one transaction and
    returns before the caller's next await, so the in-memory limiter's check-and-act stays
    atomic. ``retention_s``: ledger rows older than this are dropped; ``keep_settled_s``: how
    long a settlement's request id is remembered (a settle repeated within it is a no-op).
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        keep_settled_s: float = DAY_S,
    ) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            ":memory:" if self.path is None else str(self.path), isolation_level=None, check_same_thread=False
        )
        self._lock = threading.Lock()
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.retention_s = retention_s
        self.keep_settled_s = keep_settled_s
        self._num_settled = 0

    def budget_used(self, key: str, window: int) -> int:
        with self._lock:
            row = self._db.execute("SELECT window, used FROM budgets WHERE key = ?", (key,)).fetchone()
        return int(row[1]) if row is not None and row[0] == window else 0

    def settle(
        self, request_id: str, now: float, row: LedgerRow, updates: Sequence[BudgetUpdate]
    ) -> tuple[bool, list[int]]:
        """Apply one settlement: ``(duplicate, indices of updates whose soft threshold it
        crossed)``; a request id already settled changes nothing."""
        crossed: list[int] = []
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                inserted = db.execute(
                    "INSERT OR IGNORE INTO settled (request_id, at) VALUES (?, ?)", (request_id, now)
                ).rowcount
                if not inserted:
                    db.execute("ROLLBACK")
                    return True, []
                for index, update in enumerate(updates):
                    stored = db.execute(
                        "SELECT window, used, soft FROM budgets WHERE key = ?", (update.key,)
                    ).fetchone()
                    same = stored is not None and stored[0] == update.window
                    used = (int(stored[1]) if same else 0) + update.amount
                    fired = stored is not None and stored[2] == update.window
                    soft = stored[2] if stored is not None else None
                    if update.soft is not None and not fired and used >= update.soft:
                        soft = update.window
                        crossed.append(index)
                    db.execute(
                        "INSERT OR REPLACE INTO budgets (key, window, used, soft) VALUES (?, ?, ?, ?)",
                        (update.key, update.window, used, soft),
                    )
                db.execute(
                    "INSERT INTO ledger VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (tenant, hour, model, key_id, batch) DO UPDATE SET "
                    "requests = requests + excluded.requests, input = input + excluded.input, "
                    "cached = cached + excluded.cached, output = output + excluded.output, "
                    "cost = cost + excluded.cost",
                    (
                        row.tenant,
                        row.hour,
                        row.model,
                        row.key_id,
                        int(row.batch),
                        row.requests,
                        row.input,
                        row.cached,
                        row.output,
                        row.cost,
                    ),
                )
                self._num_settled += 1
                if self._num_settled % 1000 == 1:
                    self._prune(now)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return False, crossed

    def _prune(self, now: float) -> None:
        self._db.execute("DELETE FROM settled WHERE at < ?", (now - self.keep_settled_s,))
        self._db.execute("DELETE FROM ledger WHERE hour < ?", (int((now - self.retention_s) // HOUR_S),))

    def ledger(self, tenants: Sequence[str], start_hour: int, end_hour: int) -> list[LedgerRow]:
        marks = ",".join("?" * len(tenants))
        with self._lock:
            found = self._db.execute(
                "SELECT tenant, hour, model, key_id, batch, requests, input, cached, output, cost "
                f"FROM ledger WHERE tenant IN ({marks}) AND hour >= ? AND hour < ? "
                "ORDER BY tenant, hour, model, key_id, batch",
                (*tenants, start_hour, end_hour),
            ).fetchall()
        return [LedgerRow(t, h, m, k, bool(b), r, i, c, o, x) for t, h, m, k, b, r, i, c, o, x in found]

    def sums(self, tenants: Sequence[str], query: LedgerQuery) -> Sums:
        """``query`` over ``tenants``, summed by SQLite (one GROUP BY, the bucket computed in SQL)."""
        columns = {"project_id": "tenant", "model": "model", "api_key_id": "key_id", "batch": "batch"}
        groups = [columns[g] for g in query.group_by]
        where = [f"tenant IN ({','.join('?' * len(tenants))})", "hour >= ?", "hour < ?"]
        params: list[Any] = [*tenants, query.start_hour, query.end_hour]
        for column, wanted in (("model", query.models), ("key_id", query.key_ids)):
            if wanted:
                where.append(f"{column} IN ({','.join('?' * len(wanted))})")
                params += sorted(wanted)
        group_sql = "".join(f", {g}" for g in groups)
        sql = (
            f"SELECT (hour - ?) / ? AS b{group_sql}, SUM(requests), SUM(input), SUM(cached), "
            f"SUM(output), SUM(cost) FROM ledger WHERE {' AND '.join(where)} GROUP BY b{group_sql}"
        )
        with self._lock:
            found = self._db.execute(sql, (query.start_hour, query.width_hours, *params)).fetchall()
        n = len(groups)
        sums: Sums = {}
        for row in found:
            values = tuple(
                (v or None) if g == "api_key_id" else bool(v) if g == "batch" else v
                for g, v in zip(query.group_by, row[1 : 1 + n], strict=True)
            )
            sums[(row[0], values)] = list(row[1 + n :])
        return sums

    def ledger_all(self, start_hour: int, end_hour: int) -> list[LedgerRow]:
        """Every tenant's rows in ``[start_hour, end_hour)``."""
        with self._lock:
            names = [t for (t,) in self._db.execute("SELECT DISTINCT tenant FROM ledger").fetchall()]
        return self.ledger(names, start_hour, end_hour) if names else []

    def close(self) -> None:
        with self._lock:
            self._db.close()


def buckets(
    rows: Iterable[LedgerRow],
    *,
    start_time: int,
    end_time: int,
    bucket_width_s: int,
    group_by: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """``rows`` summed into OpenAI's organization Usage API buckets (see :func:`page`)."""
    first = start_time - start_time % bucket_width_s
    query = LedgerQuery(first // HOUR_S, -(-end_time // HOUR_S), bucket_width_s // HOUR_S, tuple(group_by))
    return page(
        sum_rows(rows, query),
        start_time=start_time,
        end_time=end_time,
        bucket_width_s=bucket_width_s,
        group_by=group_by,
    )


def page(
    sums: Sums, *, start_time: int, end_time: int, bucket_width_s: int, group_by: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Sums (as a store answers a :class:`LedgerQuery` whose first hour is ``start_time``
    aligned to the width) as OpenAI's organization Usage API buckets (``object: bucket``, each
    with its ``results``): one bucket per ``bucket_width_s`` from ``start_time`` (aligned to the
    width, UTC) to ``end_time``; results grouped by ``group_by`` fields of :data:`GROUPS`."""
    first = start_time - start_time % bucket_width_s
    # Results in a bucket ordered by their group values as text; each group's rank found once.
    groups = sorted({key for _, key in sums}, key=lambda key: tuple(str(v) for v in key))
    rank = {key: i for i, key in enumerate(groups)}
    by_bucket: dict[int, list[tuple[tuple[Any, ...], list[int]]]] = {}
    for (index, key), total in sorted(sums.items(), key=lambda item: (item[0][0], rank[item[0][1]])):
        by_bucket.setdefault(index, []).append((key, total))
    where = {g: i for i, g in enumerate(group_by)}
    tenant_at, model_at, key_at, batch_at = (where.get(g) for g in GROUPS)
    out = []
    index = 0
    while first + index * bucket_width_s < end_time:
        start = first + index * bucket_width_s
        results = []
        for key, total in by_bucket.get(index, ()):
            results.append(
                {
                    "object": "organization.usage.completions.result",
                    "input_tokens": total[1],
                    "output_tokens": total[3],
                    "input_cached_tokens": total[2],
                    "num_model_requests": total[0],
                    "cost_micros": total[4],  # batchgate's own: micro-dollars at the configured prices
                    "project_id": None if tenant_at is None else key[tenant_at],
                    "user_id": None,
                    "api_key_id": None if key_at is None else key[key_at],
                    "model": None if model_at is None else key[model_at],
                    "batch": None if batch_at is None else key[batch_at],
                }
            )
        out.append(
            {"object": "bucket", "start_time": start, "end_time": start + bucket_width_s, "results": results}
        )
        index += 1
    return out


def _group_value(row: LedgerRow, group: str) -> Any:
    if group == "project_id":
        return row.tenant
    if group == "model":
        return row.model
    if group == "api_key_id":
        return row.key_id or None
    if group == "batch":
        return row.batch
    raise ValueError(f"group_by: unknown field {group!r} (one of {', '.join(GROUPS)})")
