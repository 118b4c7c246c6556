"""API keys: generation, hashing, constant-time lookup, and run-time issue/revoke in Redis.

Only hashes are ever stored (``sha256:<64 hex>``, the form the tenants file uses). A raw key is
seen once: when ``new_key`` makes it, and when a request presents it. Never log either.

Static keys come from the tenants file. With Redis configured, keys can also be issued and
revoked while the gateway runs (``batchgate keys new`` / ``keys revoke``); revocation also
applies to static keys, so a leaked key is cut off without a restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from tenancy.config import KEY_HASH_PATTERN, TenancyConfig, Tenant
from tenancy.errors import LimiterUnavailableError, UnknownTenantError
from tenancy.keyspace import ISSUED_KEYS, KEY_META, REVOKED_KEYS, UNAVAILABLE_ERRORS
from tenancy.limiter import FailurePolicy

logger = logging.getLogger("batchgate.tenancy")

KEY_PREFIX = "bg-"
LOOKUP_DEADLINE_S = 1.5


def hash_key(raw_key: str) -> str:
    """The stored form of ``raw_key``: ``"sha256:" + hex(SHA-256(utf-8 bytes))``."""
    return "sha256:" + hashlib.sha256(raw_key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key (``bg-`` + 256 bits, URL-safe base64)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash_of(key_or_hash: str) -> str:
    """``key_or_hash`` as a hash: returned as is if already ``sha256:<hex>``, else hashed."""
    return key_or_hash if KEY_HASH_PATTERN.match(key_or_hash) else hash_key(key_or_hash)


def key_id_of(key_hash: str) -> str:
    """The name of a key in the ledger and the admin API (``key_`` and 16 hex digits of its hash)."""
    return "key_" + key_hash.removeprefix("sha256:")[:16]


def find_owner(key_hash: str, owners: Mapping[str, str]) -> str | None:
    """The owner of ``key_hash`` in ``owners`` (hash -> tenant), compared in constant time.

    Every entry is compared with ``hmac.compare_digest`` and the loop never exits early, so
    the time taken does not depend on which entry (if any) matches or on how much of a
    candidate's prefix does. (Linear in the number of static keys; they are few.)
    """
    probe = key_hash.encode("ascii", "replace")
    found: str | None = None
    for candidate, owner in owners.items():
        if hmac.compare_digest(candidate.encode("ascii"), probe):
            found = owner
    return found


def static_owners(config: TenancyConfig) -> dict[str, str]:
    """Every static key hash of ``config`` mapped to its tenant's name."""
    return {key_hash: tenant.name for tenant in config.tenants.values() for key_hash in tenant.key_hashes}


class KeyStore:
    """Resolves a raw API key to its :class:`Tenant`.

    Static keys come from ``config``; with a Redis ``client``, keys issued at run time are
    found too and revoked keys (static or issued) are refused. When Redis cannot be reached:
    ``fail_closed`` raises :class:`LimiterUnavailableError` (503), ``fail_open`` falls back to
    the static keys alone and logs a warning.
    """

    def __init__(
        self,
        config: TenancyConfig,
        client: aioredis.Redis | None = None,
        *,
        policy: FailurePolicy | str = FailurePolicy.FAIL_CLOSED,
        deadline_s: float = LOOKUP_DEADLINE_S,
    ) -> None:
        self._config = config
        self._owners = static_owners(config)
        self._client = client
        self._wall = time.time
        self._policy = FailurePolicy.parse(policy)
        self._deadline_s = deadline_s
        self._in_flight: dict[str, asyncio.Future[list[Any]]] = {}

    def reconfigure(self, config: TenancyConfig) -> None:
        """Resolve against ``config`` from now on (tenants and static keys changed at run time)."""
        self._config = config
        self._owners = static_owners(config)

    async def resolve(self, raw_key: str) -> Tenant | None:
        """The tenant owning ``raw_key``, or None if the key is unknown or revoked."""
        return (await self.resolve_key(raw_key))[0]

    async def resolve_key(self, raw_key: str) -> tuple[Tenant | None, dict[str, Any]]:
        """:meth:`resolve`, with the key's stored metadata (``{}`` for a static key)."""
        key_hash = hash_key(raw_key)
        static_owner = find_owner(key_hash, self._owners)
        if self._client is None:
            return self._tenant(static_owner), {}
        try:
            revoked, issued_owner, meta = await self._lookup(key_hash)
        except UNAVAILABLE_ERRORS as exc:
            if self._policy is FailurePolicy.FAIL_OPEN:
                logger.warning("tenancy: Redis unavailable for key lookup; static keys only (fail_open)")
                return self._tenant(static_owner), {}
            raise LimiterUnavailableError(f"Redis unavailable during key lookup: {exc!r}") from exc
        if revoked or key_expired(meta, self._wall()):
            return None, {}
        parsed = _meta(meta)
        if static_owner is not None:
            return self._tenant(static_owner), parsed
        if isinstance(issued_owner, bytes):
            issued_owner = issued_owner.decode()
        return self._tenant(issued_owner), parsed

    async def _lookup(self, key_hash: str) -> list[Any]:
        """Revoked?, issued owner, metadata of ``key_hash``: one pipelined round trip, shared by
        the requests that present the same key while it is in flight (a burst of one tenant's
        requests makes one lookup, not hundreds that queue for connections past the timeout).
        A request that joins sees Redis as of less than a round trip before it arrived."""
        pending = self._in_flight.get(key_hash)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(key_hash))
            self._in_flight[key_hash] = pending
            pending.add_done_callback(lambda done: self._lookup_done(key_hash, done))
        return await asyncio.shield(pending)

    def _lookup_done(self, key_hash: str, done: asyncio.Future[list[Any]]) -> None:
        if self._in_flight.get(key_hash) is done:
            del self._in_flight[key_hash]
        if not done.cancelled():
            done.exception()  # retrieved here too: every waiter may have gone

    async def _fetch(self, key_hash: str) -> list[Any]:
        assert self._client is not None
        async with asyncio.timeout(self._deadline_s):
            pipe = self._client.pipeline(transaction=False)
            pipe.sismember(REVOKED_KEYS, key_hash)
            pipe.hget(ISSUED_KEYS, key_hash)
            pipe.hget(KEY_META, key_hash)
            return list(await pipe.execute())

    def _tenant(self, name: str | None) -> Tenant | None:
        if name is None:
            return None
        tenant = self._config.tenant(name)
        if tenant is None:
            # Issued for a tenant since removed from the file: the key is dead, not an error.
            logger.warning("tenancy: an issued key belongs to tenant %r, which is not configured", name)
        return tenant


def _meta(meta: str | bytes | None) -> dict[str, Any]:
    if not meta:
        return {}
    try:
        parsed = json.loads(meta)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def key_expired(meta: str | bytes | None, now: float) -> bool:
    """Whether a key's metadata (JSON, from ``batchgate:keys:meta``) says it has expired."""
    if not meta:
        return False
    try:
        expires_at = json.loads(meta).get("expires_at")
    except (ValueError, AttributeError):
        return False
    return expires_at is not None and float(expires_at) <= now


@dataclass(frozen=True)
class IssuedKey:
    """A key just issued: the raw key (shown once) and what was stored (its hash)."""

    raw_key: str
    key_hash: str
    tenant: str


@dataclass(frozen=True)
class Revocation:
    """The result of revoking a key: its hash and the tenant it was issued to, if any."""

    key_hash: str
    issued_to: str | None


def issue_key(client: redis.Redis, tenant: str, config: TenancyConfig | None = None) -> IssuedKey:
    """Make a new key for ``tenant`` and store its hash in Redis (never the key itself).

    With ``config``, an unknown tenant raises :class:`UnknownTenantError`.
    """
    if config is not None and config.tenant(tenant) is None:
        raise UnknownTenantError(f"unknown tenant {tenant!r} (not in the tenants file)")
    raw = new_key()
    key_hash = hash_key(raw)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.srem(REVOKED_KEYS, key_hash)
        pipe.hset(ISSUED_KEYS, key_hash, tenant)
        pipe.execute()
    except UNAVAILABLE_ERRORS as exc:
        raise LimiterUnavailableError(f"Redis unavailable while issuing a key: {exc!r}") from exc
    return IssuedKey(raw_key=raw, key_hash=key_hash, tenant=tenant)


def revoke_key(client: redis.Redis, key_or_hash: str) -> Revocation:
    """Revoke a key given raw or as ``sha256:<hex>``; takes effect on the next request.

    Works for static keys too (they are added to the revoked set, which every lookup checks).
    """
    key_hash = key_hash_of(key_or_hash)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.hget(ISSUED_KEYS, key_hash)
        pipe.hdel(ISSUED_KEYS, key_hash)
        pipe.sadd(REVOKED_KEYS, key_hash)
        owner, _, _ = pipe.execute()
    except UNAVAILABLE_ERRORS as exc:
        raise LimiterUnavailableError(f"Redis unavailable while revoking a key: {exc!r}") from exc
    if isinstance(owner, bytes):
        owner = owner.decode()
    return Revocation(key_hash=key_hash, issued_to=owner)
