"""Stored responses and conversations, per tenant, behind one small interface: SQLite on one
machine, Redis in a pool.

    ResponseStore.put(tenant, id, record) / get(tenant, id) / delete(tenant, id) / aclose()

A `StoredResponse` is what a later turn needs: the response object as it was answered, this turn's
input items (ids assigned, as `input_items` lists them) and the conversation before it (so a
continuation never walks a chain whose older links may have been evicted). Every read and write
names the tenant: another tenant's id is simply not there (a 404, never a 403).

Both bound each tenant on its own (its plan's `responses_max_stored`, else
`--responses-max-stored`: gateway/bounds.py), evicting that tenant's least recently used records
first, so no tenant's writes evict another's; each eviction is counted
(`batchgate_response_store_evictions_total`).

- `SQLiteStore`: one file in `--storage-dir` (`responses.sqlite3`), or in memory without one.
  Writes run in a worker thread; a read (one row by its key) runs on the caller's thread, on a
  connection of its own that a writer never blocks (WAL), and its use is written with the next
  write.
- `RedisStore` (with `--redis-url`): `{tenant:<name>}:stored:<id>` strings with a TTL
  (`--responses-ttl`) and a per-tenant recency index `{tenant:<name>}:stored` (a sorted set); one
  Lua script writes and evicts, so any gateway of a pool reads what another wrote.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import orjson

from gateway.storage import connect
from tenancy.keyspace import tenant_tag

SQLITE_FILE = "responses.sqlite3"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    # A background run's lease (epoch seconds; gateway/responses/background.py): None when none runs.
    lease_until: float | None = None

    @property
    def response_id(self) -> str:
        return str(self.response["id"])

    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation of this response starts with: history, input, output."""
        return [*self.history, *self.input_items, *self.response.get("output", ())]

    def dumps(self) -> bytes:
        record: dict[str, Any] = {
            "response": self.response,
            "input_items": self.input_items,
            "history": self.history,
        }
        if self.lease_until is not None:
            record["lease_until"] = self.lease_until
        return orjson.dumps(record)

    @classmethod
    def loads(cls, raw: bytes) -> StoredResponse:
        data = orjson.loads(raw)
        return cls(data["response"], data["input_items"], data["history"], data.get("lease_until"))


@dataclass(frozen=True)
class StoredConversation:
    """A conversation (`/v1/conversations`): its object (id, created_at, metadata) and its items."""

    conversation: dict[str, Any]
    items: list[dict[str, Any]]

    @property
    def conversation_id(self) -> str:
        return str(self.conversation["id"])

    def dumps(self) -> bytes:
        return orjson.dumps({"conversation": self.conversation, "items": self.items})

    @classmethod
    def loads(cls, raw: bytes) -> StoredConversation:
        data = orjson.loads(raw)
        return cls(data["conversation"], data["items"])


class ResponseStore(Protocol):
    """Records (stored responses and conversations, `StoredResponse.dumps()` and
    `StoredConversation.dumps()`) by tenant and id; ids are unique across kinds (`resp_`, `conv_`).
    Contract: `get` of an id another tenant stored is None; `put` keeps the store within its bound
    (evicting the least recently used); all methods are safe to call concurrently from the event
    loop."""

    async def put(self, tenant: str, key: str, record: bytes) -> None: ...

    async def get(self, tenant: str, key: str) -> bytes | None: ...

    async def delete(self, tenant: str, key: str) -> bool: ...

    async def num_stored(self, tenant: str) -> int:
        """The tenant's records now (for /v1/usage)."""
        ...

    async def aclose(self) -> None: ...


Bound = Callable[[str], int]  # a tenant's most records (its plan's responses_max_stored)


class SQLiteStore:
    """The embedded store (see the module docstring). `path` None: in memory (lost at exit).
    `max_num_responses`: each tenant's bound, unless `bound` says a tenant's own."""

    def __init__(
        self,
        path: Path | None,
        max_num_responses: int,
        on_evict: Callable[[int], None] = lambda n: None,
        bound: Bound | None = None,
    ) -> None:
        if max_num_responses < 1:
            raise ValueError(f"max_num_responses must be at least 1, got {max_num_responses}")
        self.max_num_responses = max_num_responses
        self._bound: Bound = bound or (lambda tenant: max_num_responses)
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._db = connect(path)
        # Reads: a point read takes less time than a hop to a worker thread and back. A file has
        # a reader connection of its own (WAL: a writer never blocks it); in memory, the one db.
        self._reader, self._read_lock = (connect(path), threading.Lock()) if path else (self._db, self._lock)
        # Reads not yet written to `used`: the next write applies them first (so the LRU order is
        # right when it evicts); a crash forgets only the recency of reads since the last write.
        self._used: dict[tuple[str, str], float] = {}
        self._used_lock = threading.Lock()
        # In WAL mode, synchronous NORMAL commits without an fsync each (the WAL is synced at
        # checkpoints), so a write does not wait on the disk; a crash of the process loses nothing.
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                "used REAL NOT NULL, record BLOB NOT NULL, PRIMARY KEY (tenant, id))"
            )
            # Eviction picks a tenant's least recently used: by tenant, then use.
            self._db.execute("DROP INDEX IF EXISTS responses_used")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_tenant_used ON responses (tenant, used)")

    def count(self) -> int:
        """Every tenant's records."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def _count(self, tenant: str) -> int:
        with self._read_lock:
            rows = self._reader.execute(
                "SELECT COUNT(*) FROM responses WHERE tenant = ?", (tenant,)
            ).fetchall()
        return int(rows[0][0])

    async def num_stored(self, tenant: str) -> int:
        return await anyio.to_thread.run_sync(self._count, tenant)

    def _write_used(self) -> None:
        """Apply the pending reads' times (inside a write's lock and transaction)."""
        with self._used_lock:
            used, self._used = self._used, {}
        if used:
            self._db.executemany(
                "UPDATE responses SET used = ? WHERE tenant = ? AND id = ?",
                [(t, tenant, key) for (tenant, key), t in used.items()],
            )

    def _put(self, tenant: str, key: str, record: bytes) -> None:
        bound = max(1, self._bound(tenant))
        with self._lock, self._db:
            self._write_used()
            self._db.execute(
                "INSERT OR REPLACE INTO responses (tenant, id, used, record) VALUES (?, ?, ?, ?)",
                (tenant, key, time.time(), record),
            )
            (num,) = self._db.execute("SELECT COUNT(*) FROM responses WHERE tenant = ?", (tenant,)).fetchone()
            excess = int(num) - bound
            if excess > 0:  # this tenant's least recently used, never another tenant's
                self._db.execute(
                    "DELETE FROM responses WHERE rowid IN "
                    "(SELECT rowid FROM responses WHERE tenant = ? ORDER BY used LIMIT ?)",
                    (tenant, excess),
                )
        if excess > 0:
            self._on_evict(excess)

    def _get(self, tenant: str, key: str) -> bytes | None:
        with self._read_lock:  # fetchall: the statement ends, so no read transaction stays open
            rows = self._reader.execute(
                "SELECT record FROM responses WHERE tenant = ? AND id = ?", (tenant, key)
            ).fetchall()
        if not rows:
            return None
        with self._used_lock:
            self._used[(tenant, key)] = time.time()
        return bytes(rows[0][0])

    def _delete(self, tenant: str, response_id: str) -> bool:
        with self._lock, self._db:
            cursor = self._db.execute(
                "DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
            )
        return cursor.rowcount > 0

    async def put(self, tenant: str, key: str, record: bytes) -> None:
        await anyio.to_thread.run_sync(self._put, tenant, key, record)

    async def get(self, tenant: str, key: str) -> bytes | None:
        return self._get(tenant, key)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await anyio.to_thread.run_sync(self._delete, tenant, response_id)

    async def aclose(self) -> None:
        with self._lock:
            with self._db:
                self._write_used()
            self._db.close()
        if self._reader is not self._db:
            with self._read_lock:
                self._reader.close()


# KEYS: the response's key, the tenant's recency index. ARGV: id, record, ttl seconds, bound,
# the key prefix of the tenant's responses. Returns how many responses were evicted.
_PUT_SCRIPT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('ZADD', KEYS[2], t, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t - tonumber(ARGV[3]))
redis.call('EXPIRE', KEYS[2], ARGV[3])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if excess <= 0 then return 0 end
local old = redis.call('ZPOPMIN', KEYS[2], excess)
for i = 1, #old, 2 do redis.call('DEL', ARGV[5] .. old[i]) end
return excess
"""
_TOUCH_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return false end
local now = redis.call('TIME')
redis.call('ZADD', KEYS[2], 'XX', tonumber(now[1]) + tonumber(now[2]) / 1e6, ARGV[1])
return raw
"""


class RedisStore:
    """The shared store (see the module docstring)."""

    def __init__(
        self,
        url: str,
        ttl_s: int,
        max_num_responses: int,
        on_evict: Callable[[int], None] = lambda n: None,
        bound: Bound | None = None,
    ) -> None:
        import redis.asyncio as aioredis

        if ttl_s < 1 or max_num_responses < 1:
            raise ValueError("the response TTL and bound must be positive")
        self._client: Any = aioredis.Redis.from_url(url)
        self.ttl_s = ttl_s
        self.max_num_responses = max_num_responses
        self._bound: Bound = bound or (lambda tenant: max_num_responses)
        self._on_evict = on_evict
        self._put_script = self._client.register_script(_PUT_SCRIPT)
        self._touch_script = self._client.register_script(_TOUCH_SCRIPT)

    @staticmethod
    def _keys(tenant: str, response_id: str) -> tuple[str, str, str]:
        prefix = f"{tenant_tag(tenant)}:stored:"
        return prefix + response_id, f"{tenant_tag(tenant)}:stored", prefix

    async def put(self, tenant: str, key: str, record: bytes) -> None:
        redis_key, index, prefix = self._keys(tenant, key)
        evicted = await self._put_script(
            keys=[redis_key, index],
            args=[key, record, self.ttl_s, max(1, self._bound(tenant)), prefix],
        )
        if evicted:
            self._on_evict(int(evicted))

    async def get(self, tenant: str, key: str) -> bytes | None:
        redis_key, index, _ = self._keys(tenant, key)
        raw = await self._touch_script(keys=[redis_key, index], args=[key])
        return None if raw is None else bytes(raw)

    async def num_stored(self, tenant: str) -> int:
        _, index, _ = self._keys(tenant, "")
        now = float((await self._client.time())[0])
        # Records past their TTL are gone; their index entries go with the next write.
        return int(await self._client.zcount(index, now - self.ttl_s, "+inf"))

    async def delete(self, tenant: str, response_id: str) -> bool:
        key, index, _ = self._keys(tenant, response_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.zrem(index, response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def aclose(self) -> None:
        await self._client.aclose()
