"""The usage ledger: per-tenant, per-hour counters by model, API key and batch, and how to read them.

Settlement writes the ledger in the same atomic step as the refund and the budgets: in Redis
(``tenancy.scripts.SETTLE_SCRIPT``, one hash per tenant and hour) or, without Redis, in SQLite
(:class:`MemoryStore`: a file in the storage directory, so a restart keeps budgets and ledger,
or an in-memory database when there is no storage directory). Rows are summed into OpenAI's
organization Usage API buckets by :func:`buckets`.
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


async def read_redis_ledger(
    client: aioredis.Redis, tenants: Iterable[str], start_hour: int, end_hour: int
) -> list[LedgerRow]:
    """Every row of ``tenants`` in ``[start_hour, end_hour)``: the hours index of each tenant
    first, then one pipelined HGETALL per hour that has data."""
    tenants = list(tenants)
    pipe = client.pipeline(transaction=False)
    for tenant in tenants:
        pipe.zrangebyscore(ledger_hours_key(tenant), start_hour, f"({end_hour}")
    wanted = [(t, int(h)) for t, hours in zip(tenants, await pipe.execute(), strict=True) for h in hours]
    rows: list[LedgerRow] = []
    for chunk in range(0, len(wanted), 1000):
        part = wanted[chunk : chunk + 1000]
        pipe = client.pipeline(transaction=False)
        for tenant, hour in part:
            pipe.hgetall(ledger_prefix(tenant) + str(hour))
        for (tenant, hour), fields in zip(part, await pipe.execute(), strict=True):
            if fields:
                rows.extend(rows_of_hash(tenant, hour, fields))
    return rows


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
    """``rows`` summed into OpenAI's organization Usage API buckets (``object: bucket``, each
    with its ``results``), one bucket per ``bucket_width_s`` from ``start_time`` (aligned to the
    width, UTC) to ``end_time``; results grouped by ``group_by`` fields of :data:`GROUPS`."""
    first = start_time - start_time % bucket_width_s
    # Plain lists (requests, input, cached, output, cost) per bucket and group: a 30-day hourly
    # query sums thousands of rows, and a dataclass per addition costs most of its time.
    sums: dict[int, dict[tuple[Any, ...], list[int]]] = {}
    for row in rows:
        ts = row.hour * HOUR_S
        if not first <= ts < end_time:
            continue
        key = tuple(_group_value(row, g) for g in group_by)
        total = sums.setdefault((ts - first) // bucket_width_s, {}).setdefault(key, [0, 0, 0, 0, 0])
        total[0] += row.requests
        total[1] += row.input
        total[2] += row.cached
        total[3] += row.output
        total[4] += row.cost
    out = []
    index = 0
    while first + index * bucket_width_s < end_time:
        start = first + index * bucket_width_s
        results = []
        for key, total in sorted(sums.get(index, {}).items(), key=lambda kv: tuple(str(v) for v in kv[0])):
            grouped = dict(zip(group_by, key, strict=True))
            results.append(
                {
                    "object": "organization.usage.completions.result",
                    "input_tokens": total[1],
                    "output_tokens": total[3],
                    "input_cached_tokens": total[2],
                    "num_model_requests": total[0],
                    "cost_micros": total[4],  # batchgate's own: micro-dollars at the configured prices
                    "project_id": grouped.get("project_id"),
                    "user_id": None,
                    "api_key_id": grouped.get("api_key_id"),
                    "model": grouped.get("model"),
                    "batch": grouped.get("batch"),
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
