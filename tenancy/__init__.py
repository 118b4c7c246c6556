"""Tenants, API keys, plans, rate limits and concurrency leases (Redis and in-memory).

The gateway uses :class:`Tenancy` (``tenancy.service``); everything else is exported for
tests, tools and the CLI. ``tenancy`` imports neither ``engine`` nor ``gateway``.
"""

from __future__ import annotations

from tenancy.bucket import Reason
from tenancy.config import OPEN_TENANT, Plan, TenancyConfig, Tenant, load_config, parse_config
from tenancy.errors import (
    AuthError,
    LimiterUnavailableError,
    TenancyConfigError,
    TenancyError,
    UnknownTenantError,
)
from tenancy.keys import KeyStore, hash_key, new_key
from tenancy.limiter import Decision, FailurePolicy, Lease, Limiter, MemoryLimiter
from tenancy.redis_limiter import RedisLimiter
from tenancy.service import LeaseHolder, Tenancy
from tenancy.tokens import TokenCounter
from tenancy.usage import TenantUsage

__all__ = [
    "OPEN_TENANT",
    "AuthError",
    "Decision",
    "FailurePolicy",
    "KeyStore",
    "Lease",
    "LeaseHolder",
    "Limiter",
    "LimiterUnavailableError",
    "MemoryLimiter",
    "Plan",
    "Reason",
    "RedisLimiter",
    "TenancyConfig",
    "TenancyConfigError",
    "TenancyError",
    "Tenancy",
    "Tenant",
    "TenantUsage",
    "TokenCounter",
    "UnknownTenantError",
    "hash_key",
    "load_config",
    "new_key",
    "parse_config",
]
