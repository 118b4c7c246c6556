"""The Batch API's records in Redis (with `--redis-url`), so a pool of gateways shares them: any
gateway answers for any file or batch, and when the gateway running a batch dies, another takes
it over once its runner lease lapses. The file bytes are in the shared bucket (gateway/batches/blobs.py).

Per tenant, under its hash tag (as tenancy/keyspace.py lays out its keys)::

    {tenant:acme}:files               hash  file id -> the FileObject (JSON)
    {tenant:acme}:files:order         zset  file id -> insertion sequence (lists' order)
    {tenant:acme}:batches             hash  batch id -> {"key_id", "body"} (JSON)
    {tenant:acme}:batches:order       zset  batch id -> insertion sequence
    {tenant:acme}:seq                 string  the insertion sequence (INCR)
    {tenant:acme}:batch:<id>:lines    hash  custom_id -> [line, failed, in, cached, out, text]: the journal
    {tenant:acme}:batch:<id>:tally    hash  done, failed, input, cached, output (kept with the journal)
    {tenant:acme}:batch:<id>:runner   string  the owner running the batch, with the lease's TTL
    {tenant:acme}:batch:<id>:cancel   string  a cancel asked on any gateway

And one index across tenants (not hash-tagged: it starts from no tenant, like batchgate:keys)::

    batchgate:batches:unfinished      set   "<tenant>\\n<batch id>" of batches not yet final

Each write of a batch's record and each journal entry is one Lua script over its tenant's keys (one
slot on a Redis Cluster): a line is journaled at most once (HSETNX) and counted in the tally with
it; the lease is taken or renewed only by its owner, or by anyone once it has lapsed.
"""

from __future__ import annotations

from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batches.store import FINAL_STATUSES, LineResult, StoredBatch, Tally
from tenancy.keyspace import tenant_tag

UNFINISHED = "batchgate:batches:unfinished"

# KEYS: hash, order zset, sequence. ARGV: id, record. Insert or replace; the first write sets the order.
_PUT = """
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
# KEYS: lines, tally. ARGV: custom_id, entry, failed, input, cached, output tokens.
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'done', 1)
redis.call('HINCRBY', KEYS[2], 'failed', ARGV[3])
redis.call('HINCRBY', KEYS[2], 'input', ARGV[4])
redis.call('HINCRBY', KEYS[2], 'cached', ARGV[5])
redis.call('HINCRBY', KEYS[2], 'output', ARGV[6])
return 1
"""
# KEYS: runner. ARGV: owner, ttl ms. Take a free (or lapsed) lease, or renew our own.
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: runner. ARGV: owner.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


def _batch_key(tenant: str, batch_id: str, part: str) -> str:
    return f"{tenant_tag(tenant)}:batch:{batch_id}:{part}"


def _entry(result: LineResult) -> bytes:
    return orjson.dumps(
        [
            result.line,
            int(result.failed),
            result.input_tokens,
            result.cached_tokens,
            result.output_tokens,
            result.text.decode(),
        ]
    )


class RedisBatchStore:
    """See the module docstring."""

    shared = True

    def __init__(self, url: str) -> None:
        # Longer than tenancy's 0.5 s: a journal read of 50,000 lines takes longer than that.
        self._client: Any = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
        self._put = self._client.register_script(_PUT)
        self._record = self._client.register_script(_RECORD)
        self._claim = self._client.register_script(_CLAIM)
        self._release = self._client.register_script(_RELEASE)

    async def _put_record(self, tenant: str, kind: str, item_id: str, record: bytes) -> None:
        tag = tenant_tag(tenant)
        await self._put(keys=[f"{tag}:{kind}", f"{tag}:{kind}:order", f"{tag}:seq"], args=[item_id, record])

    async def _ordered(self, tenant: str, kind: str, *, ascending: bool) -> list[bytes]:
        """Every record of `kind` (files, batches) of the tenant, in insertion order."""
        tag = tenant_tag(tenant)
        ids = await self._client.zrange(f"{tag}:{kind}:order", 0, -1, desc=not ascending)
        if not ids:
            return []
        return [r for r in await self._client.hmget(f"{tag}:{kind}", ids) if r is not None]

    @staticmethod
    def _after(rows: list[dict[str, Any]], after: str | None, limit: int) -> list[dict[str, Any]]:
        if after is not None:
            ids = [r["id"] for r in rows]
            rows = rows[ids.index(after) + 1 :] if after in ids else []
        return rows[:limit]

    # -- files ---------------------------------------------------------------------------------

    async def put_file(self, tenant: str, body: dict[str, Any]) -> None:
        await self._put_record(tenant, "files", body["id"], orjson.dumps(body))

    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        raw = await self._client.hget(f"{tenant_tag(tenant)}:files", file_id)
        return None if raw is None else dict(orjson.loads(raw))

    async def list_files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> list[dict[str, Any]]:
        rows = [orjson.loads(r) for r in await self._ordered(tenant, "files", ascending=ascending)]
        return self._after([r for r in rows if not purpose or r["purpose"] == purpose], after, limit)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        tag = tenant_tag(tenant)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hdel(f"{tag}:files", file_id)
            pipe.zrem(f"{tag}:files:order", file_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def file_usage(self, tenant: str) -> tuple[int, int]:
        rows = await self._client.hvals(f"{tenant_tag(tenant)}:files")
        return len(rows), sum(int(orjson.loads(r)["bytes"]) for r in rows)

    # -- batches -------------------------------------------------------------------------------

    async def put_batch(self, batch: StoredBatch) -> None:
        body = batch.body
        record = orjson.dumps({"key_id": batch.key_id, "body": body})
        await self._put_record(batch.tenant, "batches", body["id"], record)
        member = f"{batch.tenant}\n{body['id']}"
        if body["status"] in FINAL_STATUSES:
            await self._client.srem(UNFINISHED, member)
        else:
            await self._client.sadd(UNFINISHED, member)

    async def get_batch(self, tenant: str, batch_id: str) -> StoredBatch | None:
        raw = await self._client.hget(f"{tenant_tag(tenant)}:batches", batch_id)
        if raw is None:
            return None
        record = orjson.loads(raw)
        return StoredBatch(tenant, record["key_id"], record["body"])

    async def list_batches(self, tenant: str, *, after: str | None, limit: int) -> list[dict[str, Any]]:
        rows = [orjson.loads(r)["body"] for r in await self._ordered(tenant, "batches", ascending=False)]
        return self._after(rows, after, limit)

    async def unfinished(self) -> list[StoredBatch]:
        batches = []
        for member in sorted(await self._client.smembers(UNFINISHED)):
            tenant, batch_id = member.decode().split("\n", 1)
            stored = await self.get_batch(tenant, batch_id)
            if stored is not None and stored.body["status"] not in FINAL_STATUSES:
                batches.append(stored)
        return sorted(batches, key=lambda b: b.body["created_at"])

    # -- the journal ---------------------------------------------------------------------------

    async def record(self, tenant: str, batch_id: str, result: LineResult) -> bool:
        keys = [_batch_key(tenant, batch_id, "lines"), _batch_key(tenant, batch_id, "tally")]
        args: list[str | bytes | int] = [
            result.custom_id,
            _entry(result),
            int(result.failed),
            result.input_tokens,
            result.cached_tokens,
            result.output_tokens,
        ]
        return bool(await self._record(keys=keys, args=args))

    async def results(self, tenant: str, batch_id: str) -> list[LineResult]:
        entries = await self._client.hgetall(_batch_key(tenant, batch_id, "lines"))
        results = []
        for custom_id, raw in entries.items():
            line, failed, num_in, num_cached, num_out, text = orjson.loads(raw)
            results.append(
                LineResult(custom_id.decode(), line, bool(failed), text.encode(), num_in, num_cached, num_out)
            )
        return sorted(results, key=lambda r: r.line)

    async def tally(self, tenant: str, batch_id: str) -> Tally:
        raw = await self._client.hmget(
            _batch_key(tenant, batch_id, "tally"), ["done", "failed", "input", "cached", "output"]
        )
        done, failed, num_in, num_cached, num_out = (int(v or 0) for v in raw)
        return done, failed, num_in, num_cached, num_out

    # -- the runner lease and cancel marks -----------------------------------------------------

    async def claim(self, tenant: str, batch_id: str, owner: str, ttl_s: float) -> bool:
        keys = [_batch_key(tenant, batch_id, "runner")]
        return bool(await self._claim(keys=keys, args=[owner, max(1, int(ttl_s * 1000))]))

    async def release(self, tenant: str, batch_id: str, owner: str) -> None:
        await self._release(keys=[_batch_key(tenant, batch_id, "runner")], args=[owner])

    async def lease_left(self, tenant: str, batch_id: str) -> float:
        left_ms = await self._client.pttl(_batch_key(tenant, batch_id, "runner"))
        return max(0, int(left_ms)) / 1000

    async def mark_cancel(self, tenant: str, batch_id: str) -> None:
        await self._client.set(_batch_key(tenant, batch_id, "cancel"), b"1")

    async def cancel_marked(self, tenant: str, batch_id: str) -> bool:
        return bool(await self._client.exists(_batch_key(tenant, batch_id, "cancel")))

    async def aclose(self) -> None:
        await self._client.aclose()
