"""The response store in Redis (`--redis-url`), shared by a pool's gateways: the interface and the
formats are gateway/responses/store.py's.

Keys, all hash-tagged by tenant (`{tenant:<name>}`), each with the TTL `--responses-ttl`:

    {t}:stored:<id>   a record the tenant can read: a string (format 1, conversations, marks),
                      or a hash (format 2) of `record`, `parent` and `refs` (records linking to it)
    {t}:part:<id>     a format 2 record deleted or evicted while `refs` > 0 (a 404 for its id),
                      kept for them until the last one goes
    {t}:stored        the recency index of the readable records (a sorted set)

One Lua script each writes and evicts, reads a record and its chain, or deletes, so a lookup is
one round trip and every link is kept consistent whichever gateway of a pool writes. A record's
write extends its ancestors' TTL to its own, so a chain never loses an older link to its TTL first;
a record unused for the TTL leaves the index at the next write (hidden, if records link to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.responses.store import Bound
from tenancy.keyspace import tenant_tag

# KEYS[1]: the tenant's recency index. ARGV[1], ARGV[2]: the prefixes of its readable records and
# of its hidden parts. The functions every script below starts with.
_LIB = """
local MAX_CHAIN = 100000  -- a walk's bound: links never loop, but Redis must never spin
local function readable(id) return ARGV[1] .. id end
local function part(id) return ARGV[2] .. id end
-- the key holding id's record (readable first, then hidden), or nil
local function find(id)
  if redis.call('EXISTS', readable(id)) == 1 then return readable(id) end
  if redis.call('EXISTS', part(id)) == 1 then return part(id) end
  return nil
end
local function linked(key) return redis.call('TYPE', key).ok == 'hash' end
-- one record less links to `id`: a hidden one with none left goes, and so on up the chain
local function unlink(id)
  for _ = 1, MAX_CHAIN do
    if not id then return end
    local key = find(id)
    if not key or not linked(key) then return end
    local refs = redis.call('HINCRBY', key, 'refs', -1)
    if refs > 0 or key ~= part(id) then return end
    id = redis.call('HGET', key, 'parent')
    redis.call('DEL', key)
  end
end
-- delete or evict a readable record: hidden while records link to it, else gone with its link
local function drop(id)
  local key = readable(id)
  redis.call('ZREM', KEYS[1], id)
  if redis.call('EXISTS', key) == 0 then return 0 end
  if not linked(key) then redis.call('DEL', key) return 1 end
  if tonumber(redis.call('HGET', key, 'refs') or '0') > 0 then
    redis.call('RENAME', key, part(id))  -- keeps its TTL
    return 1
  end
  local parent = redis.call('HGET', key, 'parent')
  redis.call('DEL', key)
  if parent then unlink(parent) end
  return 1
end
-- note the use of id at Redis's clock, drop what was not used for its TTL (a string has expired;
-- a hash may live on for its children, but is no longer the tenant's to read) and this tenant's
-- least recently used past the bound; how many were evicted
local function index(id, ttl, bound)
  local now = redis.call('TIME')
  local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
  redis.call('ZADD', KEYS[1], t, id)
  local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t - ttl, 'LIMIT', 0, 1000)
  for i = 1, #stale do drop(stale[i]) end
  redis.call('EXPIRE', KEYS[1], ttl)
  local excess = redis.call('ZCARD', KEYS[1]) - bound
  if excess <= 0 then return 0 end
  local old = redis.call('ZRANGE', KEYS[1], 0, excess - 1)
  for i = 1, #old do drop(old[i]) end
  return excess
end
"""
# ARGV[3..6]: id, record, ttl seconds, bound. Returns how many were evicted.
_PUT_SCRIPT = (
    _LIB
    + """
local key = readable(ARGV[3])
if redis.call('EXISTS', part(ARGV[3])) == 1 then redis.call('RENAME', part(ARGV[3]), key) end
if redis.call('EXISTS', key) == 1 and linked(key) then
  -- a linked record written whole again: it stays a hash for what links to it, a root now
  local before = redis.call('HGET', key, 'parent')
  redis.call('HSET', key, 'record', ARGV[4])
  redis.call('HDEL', key, 'parent')
  redis.call('EXPIRE', key, ARGV[5])
  if before then unlink(before) end
else
  redis.call('SET', key, ARGV[4], 'EX', ARGV[5])
end
return index(ARGV[3], tonumber(ARGV[5]), tonumber(ARGV[6]))
"""
)
# ARGV[3..7]: id, record, ttl seconds, bound, parent ('' for none). Returns how many were
# evicted, or -1 (nothing written) when the parent is no longer stored.
_PUT_LINKED_SCRIPT = (
    _LIB
    + """
local id, parent, ttl = ARGV[3], ARGV[7], tonumber(ARGV[5])
local key = readable(id)
if redis.call('EXISTS', part(id)) == 1 then redis.call('RENAME', part(id), key) end
if redis.call('EXISTS', key) == 1 and not linked(key) then redis.call('DEL', key) end
local before = redis.call('HGET', key, 'parent') or ''
if parent ~= '' and parent ~= before then
  local pkey = find(parent)
  if not pkey or not linked(pkey) then return -1 end
  redis.call('HINCRBY', pkey, 'refs', 1)
end
if before ~= '' and before ~= parent then unlink(before) end
redis.call('HSET', key, 'record', ARGV[4])
redis.call('HSETNX', key, 'refs', 0)
if parent ~= '' then redis.call('HSET', key, 'parent', parent) else redis.call('HDEL', key, 'parent') end
redis.call('EXPIRE', key, ttl)
-- its ancestors live as long as it does
local up = parent ~= '' and parent or nil
for _ = 1, MAX_CHAIN do
  local pkey = up and find(up)
  if not pkey then break end
  redis.call('EXPIRE', pkey, ttl)
  up = redis.call('HGET', pkey, 'parent')
end
return index(id, ttl, tonumber(ARGV[6]))
"""
)
# ARGV[3]: id; ARGV[4]: '1' for the whole chain. The record (and its ancestors', newest first),
# its use noted in the index; false when the tenant has no readable record of that id.
_GET_SCRIPT = (
    _LIB
    + """
local key = readable(ARGV[3])
if redis.call('EXISTS', key) == 0 then return false end
local now = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'XX', tonumber(now[1]) + tonumber(now[2]) / 1e6, ARGV[3])
local out = {}
while key and #out < MAX_CHAIN do
  if not linked(key) then
    out[#out + 1] = redis.call('GET', key)
    break
  end
  local fields = redis.call('HMGET', key, 'record', 'parent')
  out[#out + 1] = fields[1]
  if ARGV[4] ~= '1' or not fields[2] then break end
  key = find(fields[2])
end
return out
"""
)
# ARGV[3]: id. 1 when the tenant had a readable record of it.
_DELETE_SCRIPT = _LIB + "\nreturn drop(ARGV[3])\n"


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
        self._put_linked_script = self._client.register_script(_PUT_LINKED_SCRIPT)
        self._get_script = self._client.register_script(_GET_SCRIPT)
        self._delete_script = self._client.register_script(_DELETE_SCRIPT)

    @staticmethod
    def _keys(tenant: str) -> tuple[list[str], list[str]]:
        """The scripts' KEYS and their first ARGV (the prefixes of `_LIB`)."""
        tag = tenant_tag(tenant)
        return [f"{tag}:stored"], [f"{tag}:stored:", f"{tag}:part:"]

    def _evicted(self, num: Any) -> None:
        if num and int(num) > 0:
            self._on_evict(int(num))

    async def put(self, tenant: str, key: str, record: bytes) -> None:
        keys, prefixes = self._keys(tenant)
        bound = max(1, self._bound(tenant))
        self._evicted(await self._put_script(keys=keys, args=[*prefixes, key, record, self.ttl_s, bound]))

    async def put_linked(self, tenant: str, key: str, record: bytes, parent: str | None) -> bool:
        keys, prefixes = self._keys(tenant)
        bound = max(1, self._bound(tenant))
        args: list[str | bytes | int] = [*prefixes, key, record, self.ttl_s, bound, parent or ""]
        evicted = await self._put_linked_script(keys=keys, args=args)
        if int(evicted) < 0:
            return False
        self._evicted(evicted)
        return True

    async def _read(self, tenant: str, key: str, whole: bool) -> list[bytes] | None:
        keys, prefixes = self._keys(tenant)
        raws = await self._get_script(keys=keys, args=[*prefixes, key, "1" if whole else "0"])
        return None if raws is None else [bytes(raw) for raw in raws]

    async def get(self, tenant: str, key: str) -> bytes | None:
        raws = await self._read(tenant, key, whole=False)
        return None if raws is None else raws[0]

    async def chain(self, tenant: str, key: str) -> list[bytes] | None:
        return await self._read(tenant, key, whole=True)

    async def num_stored(self, tenant: str) -> int:
        (index,), _ = self._keys(tenant)
        now = float((await self._client.time())[0])
        # Records past their TTL are gone; their index entries go with the next write.
        return int(await self._client.zcount(index, now - self.ttl_s, "+inf"))

    async def delete(self, tenant: str, response_id: str) -> bool:
        keys, prefixes = self._keys(tenant)
        return bool(await self._delete_script(keys=keys, args=[*prefixes, response_id]))

    async def aclose(self) -> None:
        await self._client.aclose()
