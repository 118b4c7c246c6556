"""Plans, tenants, prices and keys changed at run time, in Redis, with an audit log (the admin API's and
the CLI's one implementation).

The tenants file stays the way to bootstrap: the configuration every gateway serves is the
file's tables with the ones stored here merged over them, table by table (a plan, tenant or
model's price set here replaces the file's of that name; one deleted here is gone even if the
file has it),
validated by the same rules as the file (``tenancy.config``). So a change made here wins over
the file, also after a restart. Every change bumps ``batchgate:admin:version``; each gateway
polls it (:class:`ConfigWatcher`, every ``POLL_S``) and reloads, so a change applies to the
next request on every gateway within a second.

Keys: issued here with optional expiry and a name; only their hashes and metadata are stored,
the raw key is returned once. Rotation issues a new key with the old one's metadata and revokes
the old. Nothing written here, and nothing in the audit log, holds a raw key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tenancy.config import TenancyConfig, config_from_dict, key_budgets
from tenancy.errors import LimiterUnavailableError, TenancyConfigError, UnknownTenantError
from tenancy.keys import IssuedKey, hash_key, key_hash_of, key_id_of, new_key
from tenancy.keyspace import (
    ADMIN_AUDIT,
    ADMIN_PLANS,
    ADMIN_PRICES,
    ADMIN_TENANTS,
    ADMIN_VERSION,
    ISSUED_KEYS,
    KEY_META,
    REVOKED_KEYS,
    UNAVAILABLE_ERRORS,
)

logger = logging.getLogger("batchgate.tenancy")

POLL_S = 0.5
MAX_AUDIT_ENTRIES = 100_000
_DELETED = "null"
# Each section of the tenants file that the API changes: its Redis hash and its audit noun.
_SECTIONS = {
    "plans": (ADMIN_PLANS, "plan"),
    "tenants": (ADMIN_TENANTS, "tenant"),
    "prices": (ADMIN_PRICES, "price"),
}


class NotFoundError(LookupError):
    """No plan, tenant or key of that name (the API answers 404)."""


@dataclass(frozen=True)
class KeyInfo:
    """What is stored about a key: never the key itself."""

    key_hash: str
    key_id: str
    tenant: str
    name: str = ""
    created_at: float | None = None
    expires_at: float | None = None
    static: bool = False  # from the tenants file
    revoked: bool = False
    budgets: dict[str, Any] | None = None  # the key's own budget_* fields

    def body(self, now: float) -> dict[str, Any]:
        return {
            "key_hash": self.key_hash,
            "key_id": self.key_id,
            "tenant": self.tenant,
            "name": self.name,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "static": self.static,
            "budgets": self.budgets or {},
            "active": not self.revoked and (self.expires_at is None or self.expires_at > now),
        }


class AdminStore:
    """Run-time changes over the tenants file ``base``, in Redis (see the module docstring).

    Every method raises :class:`LimiterUnavailableError` when Redis cannot be reached,
    :class:`TenancyConfigError` for a change the rules refuse, :class:`NotFoundError` for a
    name that does not exist."""

    def __init__(
        self, client: aioredis.Redis, base: TenancyConfig, *, wall: Callable[[], float] = time.time
    ) -> None:
        self.client = client
        self.base = base
        self._wall = wall

    async def _run(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except UNAVAILABLE_ERRORS as exc:
            raise LimiterUnavailableError(f"Redis unavailable during {what}: {exc!r}") from exc

    # -- the configuration -------------------------------------------------------------------

    async def version(self) -> int:
        return int(await self._run("a config poll", lambda: self.client.get(ADMIN_VERSION)) or 0)

    async def _overrides(self) -> dict[str, dict[str, str]]:
        """Each section's stored tables (name -> JSON, or "null" for deleted)."""

        async def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key, _ in _SECTIONS.values():
                pipe.hgetall(key)
            return list(await pipe.execute())

        stored = await self._run("a config read", read)
        return {section: dict(tables) for section, tables in zip(_SECTIONS, stored, strict=True)}

    def merged(
        self, stored: Mapping[str, Mapping[str, str]], *, extra: dict[str, Any] | None = None
    ) -> TenancyConfig:
        """The file's tables with ``stored``'s (per section, name -> JSON or "null" for deleted)
        over them, validated; ``extra``: one more change, as ``{section: {name: table | None}}``."""
        source = self.base.source
        raw: dict[str, dict[str, Any]] = {section: dict(source.get(section, {})) for section in _SECTIONS}
        for section, tables in stored.items():
            for name, text in tables.items():
                _apply(raw[section], name, self._keeping_keys(section, name, json.loads(text)))
        for section, changes in (extra or {}).items():
            for name, table in changes.items():
                _apply(raw[section], name, self._keeping_keys(section, name, table))
        return config_from_dict({k: v for k, v in raw.items() if v or k != "prices"})

    def _keeping_keys(self, section: str, name: str, table: Any) -> Any:
        """A tenant's stored table with the keys the file declares for it: a run-time change of a
        tenant (which holds no keys: they go through the key verbs) keeps the file's keys."""
        if section != "tenants" or not isinstance(table, dict) or "keys" in table:
            return table
        keys = self.base.source.get("tenants", {}).get(name, {}).get("keys")
        return table if not keys else {**table, "keys": list(keys)}

    async def config(self) -> TenancyConfig:
        """The configuration to serve now."""
        return self.merged(await self._overrides())

    async def _change(
        self, section: str, name: str, table: dict[str, Any] | None, actor: str, action: str
    ) -> TenancyConfig:
        stored = await self._overrides()
        key, noun = _SECTIONS[section]
        if table is None and name not in self.merged(stored).source[section]:
            raise NotFoundError(f"no {noun} named {name!r}")
        config = self.merged(stored, extra={section: {name: table}})  # refuses what the file would

        async def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(key, name, _DELETED if table is None else json.dumps(table, sort_keys=True))
            _audit(pipe, self._wall(), actor, action, f"{noun}:{name}", table)
            pipe.incr(ADMIN_VERSION)
            await pipe.execute()

        await self._run(action, write)
        return config

    async def put_plan(self, name: str, table: dict[str, Any], actor: str) -> TenancyConfig:
        return await self._change("plans", name, _table(table), actor, "plan.put")

    async def delete_plan(self, name: str, actor: str) -> TenancyConfig:
        return await self._change("plans", name, None, actor, "plan.delete")

    async def put_tenant(self, name: str, table: dict[str, Any], actor: str) -> TenancyConfig:
        table = _table(table)
        if "keys" in table:
            # Keys are issued through the key verbs, which store their hash and metadata.
            raise TenancyConfigError(f"tenants.{name}.keys: issue keys with the keys API, not in the table")
        return await self._change("tenants", name, table, actor, "tenant.put")

    async def delete_tenant(self, name: str, actor: str) -> TenancyConfig:
        return await self._change("tenants", name, None, actor, "tenant.delete")

    async def put_price(self, model: str, table: dict[str, Any], actor: str) -> TenancyConfig:
        """Set ``model``'s price (the file's ``[prices."model"]`` fields, USD per 1M tokens): the
        next request of that model, on every gateway after its poll, reserves and pays it."""
        return await self._change("prices", model, _table(table), actor, "price.put")

    async def delete_price(self, model: str, actor: str) -> TenancyConfig:
        """Remove ``model``'s price (it then costs nothing; token budgets still count)."""
        return await self._change("prices", model, None, actor, "price.delete")

    # -- keys --------------------------------------------------------------------------------

    async def issue_key(
        self,
        tenant: str,
        actor: str,
        *,
        name: str = "",
        expires_at: float | None = None,
        budgets: dict[str, Any] | None = None,
    ) -> IssuedKey:
        """A new key for ``tenant`` (which must exist now), with its own budgets if given (the
        ``budget_*`` fields); the raw key is in the result only."""
        if (await self.config()).tenant(tenant) is None:
            raise UnknownTenantError(f"unknown tenant {tenant!r}")
        if expires_at is not None and expires_at <= self._wall():
            raise TenancyConfigError(f"expires_at: must be in the future, got {expires_at}")
        raw = new_key()
        key_hash = hash_key(raw)
        if budgets:
            key_budgets(_table(budgets), key_id_of(key_hash))  # refuses what the file would
        meta = {"tenant": tenant, "name": name[:200], "created_at": self._wall(), "expires_at": expires_at}
        if budgets:
            meta["budgets"] = budgets

        async def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.srem(REVOKED_KEYS, key_hash)
            pipe.hset(ISSUED_KEYS, key_hash, tenant)
            pipe.hset(KEY_META, key_hash, json.dumps(meta))
            _audit(pipe, self._wall(), actor, "key.issue", f"key:{key_id_of(key_hash)}", meta)
            await pipe.execute()

        await self._run("key.issue", write)
        return IssuedKey(raw_key=raw, key_hash=key_hash, tenant=tenant)

    async def keys(self, tenant: str) -> list[KeyInfo]:
        """Every key of ``tenant``: static ones from the file and those issued here."""

        async def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(KEY_META)
            pipe.hgetall(ISSUED_KEYS)
            pipe.smembers(REVOKED_KEYS)
            return list(await pipe.execute())

        metas, issued, revoked = await self._run("key.list", read)
        config = await self.config()
        found = []
        static = config.tenant(tenant)
        for key_hash in static.key_hashes if static is not None else ():
            found.append(
                KeyInfo(key_hash, key_id_of(key_hash), tenant, static=True, revoked=key_hash in revoked)
            )
        for key_hash, owner in sorted(issued.items()):
            if owner != tenant:
                continue
            meta = json.loads(metas.get(key_hash) or "{}")
            found.append(
                KeyInfo(
                    key_hash,
                    key_id_of(key_hash),
                    tenant,
                    meta.get("name", ""),
                    meta.get("created_at"),
                    meta.get("expires_at"),
                    revoked=key_hash in revoked,
                    budgets=meta.get("budgets"),
                )
            )
        return found

    async def revoke_key(self, key_or_hash: str, actor: str) -> KeyInfo:
        key_hash = key_hash_of(key_or_hash)
        info = await self._find_key(key_hash)

        async def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hdel(ISSUED_KEYS, key_hash)
            pipe.sadd(REVOKED_KEYS, key_hash)
            _audit(pipe, self._wall(), actor, "key.revoke", f"key:{info.key_id}", {"tenant": info.tenant})
            await pipe.execute()

        await self._run("key.revoke", write)
        return info

    async def rotate_key(self, key_or_hash: str, actor: str, *, expires_at: float | None = None) -> IssuedKey:
        """A new key for the old one's tenant (its name and, unless given, its expiry); the old
        one is revoked at once."""
        old = await self._find_key(key_hash_of(key_or_hash))
        if old.revoked:
            raise TenancyConfigError(f"key {old.key_id} is revoked; issue a new one instead")
        issued = await self.issue_key(
            old.tenant,
            actor,
            name=old.name,
            expires_at=expires_at if expires_at is not None else old.expires_at,
        )
        await self.revoke_key(old.key_hash, actor)
        return issued

    async def _find_key(self, key_hash: str) -> KeyInfo:
        config = await self.config()
        for tenant in config.tenants.values():
            if key_hash in tenant.key_hashes:
                return next(k for k in await self.keys(tenant.name) if k.key_hash == key_hash)

        async def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(KEY_META, key_hash)
            pipe.sismember(REVOKED_KEYS, key_hash)
            return list(await pipe.execute())

        meta_text, revoked = await self._run("key.find", read)
        if not meta_text:
            raise NotFoundError(f"no key {key_id_of(key_hash)} was issued")
        meta = json.loads(meta_text)
        return KeyInfo(
            key_hash,
            key_id_of(key_hash),
            meta["tenant"],
            meta.get("name", ""),
            meta.get("created_at"),
            meta.get("expires_at"),
            revoked=bool(revoked),
            budgets=meta.get("budgets"),
        )

    async def set_key_budgets(self, key_or_hash: str, budgets: dict[str, Any], actor: str) -> KeyInfo:
        """Set one issued key's own budgets (``{}`` removes them); the next request applies them."""
        key_hash = key_hash_of(key_or_hash)
        info = await self._find_key(key_hash)
        if info.static:
            raise TenancyConfigError(
                f"key {info.key_id} is from the tenants file: issue a key to give it budgets"
            )
        budgets = _table(budgets)
        key_budgets(budgets, info.key_id)

        async def write() -> None:
            meta = json.loads(await self.client.hget(KEY_META, key_hash) or "{}")
            if budgets:
                meta["budgets"] = budgets
            else:
                meta.pop("budgets", None)
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(KEY_META, key_hash, json.dumps(meta))
            _audit(pipe, self._wall(), actor, "key.budgets", f"key:{info.key_id}", budgets)
            await pipe.execute()

        await self._run("key.budgets", write)
        return await self._find_key(key_hash)

    # -- the audit log -----------------------------------------------------------------------

    async def record(self, actor: str, action: str, target: str, detail: Any) -> None:
        """Append a change made elsewhere (a LoRA adapter loaded through the admin API) to the
        audit log; ``detail`` must hold no secret."""

        async def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            _audit(pipe, self._wall(), actor, action, target, detail)
            await pipe.execute()

        await self._run(action, write)

    async def audit(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` changes, newest first."""
        entries = await self._run("audit.read", lambda: self.client.xrevrange(ADMIN_AUDIT, count=limit))
        out = []
        for entry_id, fields in entries:
            out.append(
                {
                    "id": entry_id,
                    "at": float(fields["at"]),
                    "actor": fields["actor"],
                    "action": fields["action"],
                    "target": fields["target"],
                    "detail": json.loads(fields.get("detail") or "null"),
                }
            )
        return out


def _apply(section: dict[str, Any], name: str, table: Any) -> None:
    if table is None:
        section.pop(name, None)
    else:
        section[name] = table


def _table(table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise TenancyConfigError(f"expected a JSON object (the table's fields), got {type(table).__name__}")
    return dict(table)


def _audit(pipe: Any, now: float, actor: str, action: str, target: str, detail: Any) -> None:
    fields = {
        "at": repr(now),
        "actor": actor[:200],
        "action": action,
        "target": target,
        "detail": json.dumps(detail),
    }
    pipe.xadd(ADMIN_AUDIT, fields, maxlen=MAX_AUDIT_ENTRIES, approximate=True)


class ConfigWatcher:
    """Polls the admin version and hands each new configuration to ``apply`` (one gateway)."""

    def __init__(
        self, store: AdminStore, apply: Callable[[TenancyConfig], None], poll_s: float = POLL_S
    ) -> None:
        self.store = store
        self.apply = apply
        self.poll_s = poll_s
        self.version: int | None = None

    async def check(self) -> bool:
        """Reload if the version moved (or on the first call); whether it did. Never raises for
        Redis trouble or a stored change the rules now refuse (the last good config stays)."""
        try:
            version = await self.store.version()
            if version == self.version:
                return False
            config = await self.store.config()
        except LimiterUnavailableError:
            return False
        except TenancyConfigError as exc:
            logger.error("tenancy: the stored configuration is invalid (%s); keeping the last good one", exc)
            return False
        self.version = version
        self.apply(config)
        return True

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)
