"""Per-tenant usage counters: prompt tokens, completion tokens and settled requests.

Counters grow when a request is settled (``Limiter.settle``). The in-memory store lives in the
limiter's process; the Redis store is the ``{tenant:<name>}:usage`` hash, written by the settle
script in the same atomic step as the refund, and read here for ``batchgate usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from tenancy.errors import LimiterUnavailableError
from tenancy.keyspace import UNAVAILABLE_ERRORS, USAGE_PATTERN, tenant_of_usage_key, usage_key

USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "requests")


@dataclass(frozen=True)
class TenantUsage:
    """Totals for one tenant since its counters were created."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_requests: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, prompt_tokens: int, completion_tokens: int) -> TenantUsage:
        """These totals with one more settled request added."""
        return TenantUsage(
            self.prompt_tokens + prompt_tokens,
            self.completion_tokens + completion_tokens,
            self.num_requests + 1,
        )

    @classmethod
    def from_hash(cls, fields: Mapping[Any, Any]) -> TenantUsage:
        """Build from a Redis usage hash, str or bytes (missing fields count as 0)."""
        decoded = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in fields.items()}
        return cls(
            prompt_tokens=decoded.get("prompt_tokens", 0),
            completion_tokens=decoded.get("completion_tokens", 0),
            num_requests=decoded.get("requests", 0),
        )


class MemoryUsage:
    """Usage counters held in this process (lost on restart)."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, TenantUsage] = {}

    def add(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one settled request of ``tenant``."""
        self._by_tenant[tenant] = self._by_tenant.get(tenant, TenantUsage()).plus(
            prompt_tokens, completion_tokens
        )

    def snapshot(self) -> dict[str, TenantUsage]:
        """A copy of every tenant's totals, by tenant name."""
        return dict(sorted(self._by_tenant.items()))


async def read_redis_usage(client: aioredis.Redis) -> dict[str, TenantUsage]:
    """Every tenant's totals from Redis, by tenant name (sorted).

    Raises :class:`LimiterUnavailableError` when Redis cannot be reached.
    """
    try:
        found: dict[str, TenantUsage] = {}
        async for key in client.scan_iter(match=USAGE_PATTERN, count=500):
            tenant = tenant_of_usage_key(key)
            if tenant is not None:
                found[tenant] = TenantUsage.from_hash(await client.hgetall(usage_key(tenant)))
    except UNAVAILABLE_ERRORS as exc:
        raise LimiterUnavailableError(f"Redis unavailable while reading usage: {exc}") from exc
    return dict(sorted(found.items()))


def read_redis_usage_sync(client: redis.Redis) -> dict[str, TenantUsage]:
    """:func:`read_redis_usage` for the synchronous client the CLI uses."""
    try:
        found: dict[str, TenantUsage] = {}
        for key in client.scan_iter(match=USAGE_PATTERN, count=500):
            tenant = tenant_of_usage_key(key)
            if tenant is not None:
                found[tenant] = TenantUsage.from_hash(client.hgetall(usage_key(tenant)))
    except UNAVAILABLE_ERRORS as exc:
        raise LimiterUnavailableError(f"Redis unavailable while reading usage: {exc}") from exc
    return dict(sorted(found.items()))
