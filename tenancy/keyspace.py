"""How tenancy lays out its state in Redis, and how it connects.

Per-tenant keys share one hash tag, so a single Lua script may touch all of them even on a
Redis Cluster (they live in the same slot)::

    {tenant:acme}:tokens    hash  level, ts      token bucket (ts in Redis-clock seconds)
    {tenant:acme}:requests  hash  level, ts      request bucket
    {tenant:acme}:leases    zset  lease_id -> expiry (Redis-clock seconds)
    {tenant:acme}:lane:batch:tokens, :lane:batch:requests, :lane:batch:leases   the same for the
                            Batch API's lines (a lane of their own: batch_tokens_per_minute,
                            batch_max_concurrent_lines)
    {tenant:acme}:usage     hash  prompt_tokens, completion_tokens, requests
    {tenant:acme}:held      hash  lease_id -> budget holds of a live lease ("<key> <window> <amount>" lines)
    {tenant:acme}:budget:tenant.usd     hash  w (window index), used, soft (window whose soft
                                              threshold was crossed); also .tokens, key:<id>.usd ...
    {tenant:acme}:ledger:<hour>         hash  "<model>\t<key id>\t<batch 0|1>\t<counter>" -> count
                                              (hours since the epoch; expires after the retention)
    {tenant:acme}:ledger:hours          zset  the hours that have a ledger hash
    {tenant:acme}:settled:<request id>  string  a settlement made (idempotency), for a while

Run-time API keys are global (not per tenant) because a lookup starts from the key::

    batchgate:keys          hash  "sha256:<hex>" -> tenant name   (issued at run time)
    batchgate:keys:revoked  set   "sha256:<hex>"                   (revoked, static ones too)
    batchgate:keys:meta     hash  "sha256:<hex>" -> JSON {tenant, name, created_at, expires_at}

Plans, tenants and prices changed at run time (``tenancy.admin``), merged over the tenants file::

    batchgate:admin:plans    hash    name -> JSON table (as in the file), or "null" (deleted)
    batchgate:admin:tenants  hash    name -> JSON table, or "null"
    batchgate:admin:prices   hash    model -> JSON table (as in the file's [prices."model"]), or "null"
    batchgate:admin:version  string  bumped by every change; gateways poll it and reload
    batchgate:admin:audit    stream  who, what, when (bounded)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.retry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

ISSUED_KEYS = "batchgate:keys"
REVOKED_KEYS = "batchgate:keys:revoked"
KEY_META = "batchgate:keys:meta"
ADMIN_PLANS = "batchgate:admin:plans"
ADMIN_TENANTS = "batchgate:admin:tenants"
ADMIN_PRICES = "batchgate:admin:prices"
ADMIN_VERSION = "batchgate:admin:version"
ADMIN_AUDIT = "batchgate:admin:audit"
USAGE_PATTERN = "{tenant:*}:usage"

# Short on purpose: a request must never hang on Redis. On localhost a refused connection fails
# at once; a black-holed host costs at most connect + one retry.
CONNECT_TIMEOUT_S = 0.5
OPERATION_TIMEOUT_S = 0.5
# How long a call may wait for a free pooled connection: a burst's queue, not Redis's health, so
# as long as a limiter call may take (redis_limiter.CALL_DEADLINE_S bounds the whole call).
POOL_WAIT_S = 1.5


def tenant_tag(tenant: str) -> str:
    """The hash tag shared by every key of ``tenant``."""
    return "{tenant:" + tenant + "}"


def _lane(tenant: str, batch: bool) -> str:
    """The prefix of a lane's keys: interactive requests, or the Batch API's lines."""
    return tenant_tag(tenant) + (":lane:batch:" if batch else ":")


def tokens_key(tenant: str, batch: bool = False) -> str:
    return _lane(tenant, batch) + "tokens"


def requests_key(tenant: str, batch: bool = False) -> str:
    return _lane(tenant, batch) + "requests"


def leases_key(tenant: str, batch: bool = False) -> str:
    return _lane(tenant, batch) + "leases"


def _tenant_key(suffix: str) -> Callable[[str], str]:
    """The function that names a tenant's key of one kind: its hash tag, then ``suffix``."""

    def key(tenant: str) -> str:
        return tenant_tag(tenant) + suffix

    return key


usage_key = _tenant_key(":usage")
held_key = _tenant_key(":held")
ledger_prefix = _tenant_key(":ledger:")  # the ledger's hourly hashes are this plus the hour index
ledger_hours_key = _tenant_key(":ledger:hours")


def budget_key(tenant: str, budget_name: str) -> str:
    """``budget_name``: ``tenancy.billing.Budget.name`` (``tenant.usd``, ``key:ab12.tokens``)."""
    return tenant_tag(tenant) + ":budget:" + budget_name


def settled_key(tenant: str, request_id: str) -> str:
    return tenant_tag(tenant) + ":settled:" + request_id


def tenant_of_usage_key(key: str) -> str | None:
    """Inverse of :func:`usage_key`; None for a key that is not a usage key."""
    prefix, suffix = "{tenant:", "}:usage"
    if key.startswith(prefix) and key.endswith(suffix):
        return key[len(prefix) : -len(suffix)]
    return None


# Connections one process opens to Redis at most (each request makes one or two calls at a time).
MAX_CONNECTIONS = 256


def connection_kwargs(
    connect_timeout_s: float = CONNECT_TIMEOUT_S, operation_timeout_s: float = OPERATION_TIMEOUT_S
) -> dict[str, Any]:
    """Client options shared by the async and the sync (CLI) clients.

    One immediate retry on a connection error lets a pooled connection that died with a
    restarted Redis reconnect transparently; no backoff, so a real outage is reported fast.
    """
    return {
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": operation_timeout_s,
        "decode_responses": True,
        "health_check_interval": 0,
    }


def open_async(
    url: str,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    operation_timeout_s: float = OPERATION_TIMEOUT_S,
) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` with tenancy's short timeouts (no I/O yet). Its pool
    makes a call wait (up to POOL_WAIT_S) for a connection when MAX_CONNECTIONS are
    busy, instead of failing it: redis-py's default pool refuses the 101st concurrent call."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=max(operation_timeout_s, POOL_WAIT_S),
        retry=Retry(NoBackoff(), 1),
        **connection_kwargs(connect_timeout_s, operation_timeout_s),
    )
    return aioredis.Redis.from_pool(pool)


def open_sync(url: str) -> redis.Redis:
    """A synchronous client (for the CLI) with the same timeouts."""
    return redis.Redis.from_url(url, retry=redis.retry.Retry(NoBackoff(), 1), **connection_kwargs())


# What "Redis is unavailable" looks like from redis-py (a connection error includes "loading";
# a read-only replica is what a failover looks like); OSError covers DNS failures.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    OSError,
    TimeoutError,
)
