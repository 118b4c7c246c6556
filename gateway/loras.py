"""LoRA adapters at the gateway: who may use which, and loading them at run time.

Each adapter is served as a model of its own name, over an in-process chat model (engine/lora.py).
It is public (`--lora NAME=PATH`) or owned by a tenant (the models file's `[[loras]]`, or the
admin API with a `tenant`): an owned adapter is listed in /v1/models only to its owner's keys, and
any other caller gets the same 404 as for a name nobody serves.

    GET    /admin/loras                  every adapter: model, owner, version, content hash, rank,
                                         bytes, and each engine's adapter bytes held
    PUT    /admin/loras/{name}           body {"path": "...", "tenant": "acme" (omit: public),
                                         "model": base (omit: the main chat model)}: load or replace
    DELETE /admin/loras/{name}           unload; ?wait=false: a 409 while requests use it (nothing
                                         changes); else it is taken from new requests at once and
                                         the answer waits (up to ?timeout_s=, default 30) for the last
                                         running one, saying whether its memory was released

The admin API loads only from folders under `--lora-root` (the path resolved, symlinks
followed, before anything is opened: a path elsewhere is refused with the same 400 whether or not
it exists), and only for a tenant that exists (with tenants configured; without, adapters are
public). A gateway in front (its internal token) checked both before it asked this replica.

A replace is a new version: requests that started keep the version they pinned. In pool mode
(no in-process chat model for it) the same routes act on the replicas (gateway/pool/adapters.py),
and a replica takes them from its gateway with the internal token as well as the admin key. Each load, replace
and unload is an entry of the admin audit log (`GET /admin/audit`, with tenancy over Redis; else
only logged). What the admin API loads is recorded (`AdapterRecords`: loras.sqlite3 in
`--storage-dir`), so a restarted gateway loads it again; the models file's and `--lora` adapters
load from their declarations as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.types import EngineError
from gateway import admission
from gateway.errors import APIError, ErrorKind, from_engine_error, invalid_request
from gateway.storage import connect
from tenancy.errors import LimiterUnavailableError

if TYPE_CHECKING:
    from engine.lora import LoraAdapter

logger = logging.getLogger("batchgate.gateway")

DEFAULT_UNLOAD_TIMEOUT_S = 30.0
RECORDS_FILE = "loras.sqlite3"


@dataclass(frozen=True)
class AdapterRecord:
    """An adapter the admin API loaded: its name, folder, owner (None: public) and base model."""

    name: str
    path: str
    tenant: str | None
    model: str | None


class AdapterRecords:
    """The admin API's adapters, kept in SQLite in the storage directory (`path` None: in memory,
    lost at exit like the other embedded stores without one), one row per served name."""

    def __init__(self, path: Path | None) -> None:
        self._db = connect(path)
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS loras (name TEXT PRIMARY KEY, path TEXT NOT NULL,"
                " tenant TEXT, model TEXT)"
            )

    def put(self, record: AdapterRecord) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO loras VALUES (?, ?, ?, ?)",
                (record.name, record.path, record.tenant, record.model),
            )

    def delete(self, name: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM loras WHERE name = ?", (name,))

    def all(self) -> list[AdapterRecord]:
        with self._lock:
            rows = self._db.execute("SELECT name, path, tenant, model FROM loras ORDER BY name").fetchall()
        return [AdapterRecord(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @classmethod
    def in_storage(cls, storage_dir: str | None) -> AdapterRecords:
        return cls(Path(storage_dir) / RECORDS_FILE if storage_dir else None)


class AdapterHost(Protocol):
    """An in-process chat model that serves adapters (gateway/local/engine_backend.py's EngineBackend)."""

    lora_owners: dict[str, str | None]

    @property
    def name(self) -> str | None: ...

    def adapters(self) -> dict[str, LoraAdapter]: ...

    def adapter_bytes(self) -> int: ...

    def resident(self) -> tuple[str, ...]:
        """The adapters resident in an engine slot now."""
        ...

    async def load_lora(self, name: str, path: str, tenant: str | None) -> LoraAdapter: ...

    async def unload_lora(self, name: str, wait: bool, timeout_s: float) -> bool: ...


def visible(owner: str | None, caller: admission.Caller | None) -> bool:
    """Whether `caller` may see and use an adapter of `owner` (None: public). A gateway in front
    (pool mode) already checked; no caller (probes, the OpenAPI document) sees public ones only."""
    if owner is None:
        return True
    if caller is None:
        return False
    return caller.internal or (caller.tenant is not None and caller.tenant.name == owner)


def adapter_body(adapter: LoraAdapter, owner: str | None, model: str | None) -> dict[str, Any]:
    return {
        "object": "lora",
        "id": adapter.name,
        "model": model,
        "owner": owner,
        "version": adapter.version,
        "content_hash": adapter.content_hash,
        "rank": adapter.rank,
        "target_modules": list(adapter.target_modules),
        "bytes": adapter.nbytes,
        "path": adapter.path,
    }


def held_report(hosts: Sequence[AdapterHost]) -> dict[str, dict[str, Any]]:
    """The adapters these in-process models hold, for a gateway in front (/v1/internal/stats;
    gateway/pool/replicas.py reads it back)."""
    report: dict[str, dict[str, Any]] = {}
    for host in hosts:
        resident = set(host.resident())
        for name, adapter in host.adapters().items():
            report[name] = {
                "owner": host.lora_owners.get(name),
                "model": host.name,
                "resident": name in resident,
                "version": adapter.version,
                "content_hash": adapter.content_hash,
            }
    return report


class PoolHost(Protocol):
    """The adapters of a pool of replicas (gateway/pool/adapters.py's PoolAdapters)."""

    def serves(self, name: str) -> bool: ...

    def owner(self, name: str) -> str | None: ...

    def declare(self, record: AdapterRecord) -> None: ...

    def listing(self) -> list[dict[str, Any]]: ...

    async def load(self, name: str, path: str, tenant: str | None, model: str | None) -> dict[str, Any]: ...

    async def unload(self, name: str, wait: bool, timeout_s: float) -> bool: ...


# Appends one audit entry (actor, action, target, detail): `tenancy.admin.AdminStore.record`.
Audit = Callable[[str, str, str, Any], Awaitable[None]]


class LoraRoutes:
    """The admin routes over the in-process chat models (the first is the main one)."""

    def __init__(
        self,
        engines: Sequence[AdapterHost],
        admin_key_hash: str | None,
        records: AdapterRecords,
        audit: Audit | None = None,
        internal_token: str | None = None,
        pool: PoolHost | None = None,
        roots: Sequence[str] = (),
        tenant_exists: Callable[[str], bool] | None = None,
    ) -> None:
        """`internal_token`: a gateway in front calls these with it (pool mode); its loads are not
        recorded (the gateway owns them). `pool`: the replicas' adapters, where no in-process
        chat model is named. `roots`: the folders the admin API may load from (--lora-root);
        `tenant_exists`: whether an owner names a tenant (None: no tenants are configured)."""
        self.roots = tuple(os.path.realpath(root) for root in roots)
        self.tenant_exists = tenant_exists
        self.engines = engines
        self.admin_key_hash = admin_key_hash
        self.records = records
        self.audit = audit
        self.internal_token = internal_token
        self.pool = pool
        # /ready waits for the restore, so a restarted server serves what it had (nothing to wait
        # for when nothing was recorded)
        self.restored = not records.all()

    async def restore(self) -> None:
        """Load again what the admin API loaded before a restart (once the models have loaded);
        an adapter that cannot load now (its folder gone) is logged and left out, not retried."""
        for record in self.records.all():
            try:
                local = self._local(record.model)
                if local is None:
                    self._pool().declare(record)
                    continue
                await local.load_lora(record.name, record.path, record.tenant)
                logger.info("restored LoRA %s for %s", record.name, record.tenant or "everyone")
            except (APIError, EngineError) as exc:
                logger.error("LoRA %s from %s could not be restored: %s", record.name, record.path, exc)
        self.restored = True

    def routes(self) -> list[Route]:
        return [
            Route("/admin/loras", self._admin(self.list), methods=["GET"]),
            Route("/admin/loras/{name}", self._admin(self.load), methods=["PUT"]),
            Route("/admin/loras/{name}", self._admin(self.unload), methods=["DELETE"]),
        ]

    def _admin(self, handler: Any) -> Any:
        async def handle(request: Request) -> Response:
            if admission.internal_caller(self.internal_token, request.headers, None) is None:
                admission.check_admin(self.admin_key_hash, request.headers)
            try:
                response: Response = await handler(request)
            except EngineError as exc:
                raise from_engine_error(exc) from None
            return response

        return handle

    async def list(self, request: Request) -> Response:
        data = [
            adapter_body(adapter, backend.lora_owners.get(name), backend.name)
            for backend in self.engines
            for name, adapter in backend.adapters().items()
        ]
        held = {backend.name: backend.adapter_bytes() for backend in self.engines}
        if self.pool is not None:
            data.extend(self.pool.listing())
        return JSONResponse({"object": "list", "data": data, "bytes_held": held})

    async def load(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            body = await request.json()
        except ValueError:
            raise invalid_request("The body must be JSON.") from None
        if not isinstance(body, dict) or not isinstance(body.get("path"), str):
            raise invalid_request("The body needs `path`: the adapter's PEFT folder.", param="path")
        extra = sorted(set(body) - {"path", "tenant", "model"})
        if extra:
            raise invalid_request(f"Unknown field(s): {', '.join(extra)}.", param=extra[0])
        tenant, model = body.get("tenant"), body.get("model")
        if not isinstance(tenant, str | None) or not isinstance(model, str | None):
            raise invalid_request("`tenant` and `model` must be strings.")
        path = body["path"]
        if not self._by_gateway(request):  # a gateway in front checked these before it asked
            path = self._within_roots(path)
            self._check_owner(tenant)
        backend = self._local(model)
        if backend is None:
            replaced = self._pool().serves(name)
            answer = await self._pool().load(name, path, tenant, model)
        else:
            replaced = name in backend.lora_owners
            adapter = await backend.load_lora(name, path, tenant)
            answer = adapter_body(adapter, tenant, backend.name)
        if not self._by_gateway(request):  # a gateway's load is its own to restore
            self.records.put(AdapterRecord(name, path, tenant, model))
        logger.info("%s loaded LoRA %s for %s", self._actor(request), name, tenant or "everyone")
        detail = {k: v for k, v in answer.items() if k != "object"}
        await self._audit(request, "lora.replace" if replaced else "lora.load", name, detail)
        return JSONResponse(answer)

    def _within_roots(self, path: str) -> str:
        """`path` resolved (symlinks followed) when it is inside one of the roots; else a 400 that
        says the same whether or not anything is there."""
        if not self.roots:
            raise invalid_request(
                "The admin API loads adapters only from folders under --lora-root, and none is set.",
                param="path",
            )
        resolved = os.path.realpath(path) if os.path.isabs(path) else None
        inside = resolved is not None and any(
            os.path.commonpath((resolved, root)) == root for root in self.roots
        )
        if resolved is None or not inside:
            raise invalid_request(
                "`path` must be an absolute path inside one of the adapter roots (--lora-root).",
                param="path",
            )
        return resolved

    def _check_owner(self, tenant: str | None) -> None:
        if tenant is None:
            return
        if self.tenant_exists is None:
            raise invalid_request(
                f"No tenant named {tenant!r}: tenants are not configured (--tenants).", param="tenant"
            )
        if not self.tenant_exists(tenant):
            raise invalid_request(f"No tenant named {tenant!r}.", param="tenant")

    async def unload(self, request: Request) -> Response:
        name = request.path_params["name"]
        wait = request.query_params.get("wait", "true").lower() != "false"
        try:
            timeout_s = float(request.query_params.get("timeout_s", DEFAULT_UNLOAD_TIMEOUT_S))
        except ValueError:
            raise invalid_request("timeout_s must be a number of seconds.", param="timeout_s") from None
        backend = next((b for b in self.engines if name in b.lora_owners), None)
        if backend is not None:
            owner, model = backend.lora_owners.get(name), backend.name
            released = await backend.unload_lora(name, wait, timeout_s)
        elif self.pool is not None and self.pool.serves(name):
            owner, model = self.pool.owner(name), None
            released = await self.pool.unload(name, wait, timeout_s)
        else:
            raise APIError(ErrorKind.NOT_FOUND, f"No LoRA adapter named {name!r} is loaded.")
        self.records.delete(name)
        logger.info("%s unloaded LoRA %s (released: %s)", self._actor(request), name, released)
        detail = {"model": model, "owner": owner, "released": released}
        await self._audit(request, "lora.unload", name, detail)
        return JSONResponse({"object": "lora.deleted", "id": name, "deleted": True, "released": released})

    async def _audit(self, request: Request, action: str, name: str, detail: dict[str, Any]) -> None:
        """The change is made: an audit log that cannot be written now is logged, not an error."""
        if self.audit is None:
            return

        try:
            await self.audit(self._actor(request), action, f"lora:{name}", detail)
        except LimiterUnavailableError as exc:
            logger.error("%s of LoRA %s not in the audit log (%s): %s", action, name, exc, detail)

    def _by_gateway(self, request: Request) -> bool:
        return admission.internal_caller(self.internal_token, request.headers, None) is not None

    def _actor(self, request: Request) -> str:
        """Who made a change, for the logs: `admin@host`, or `gateway@host` (the internal token: a
        gateway in front, loading on demand)."""
        return f"{'gateway' if self._by_gateway(request) else 'admin'}@{_client(request)}"

    def _local(self, model: str | None) -> AdapterHost | None:
        """The in-process chat model `model` names (None: the main one), or None: the pool's."""
        for backend in self.engines:
            if backend.name == model or (model is None and backend is self.engines[0]):
                return backend
        if self.pool is not None:
            return None
        if not self.engines:
            raise APIError(
                ErrorKind.NOT_FOUND, "This server runs no chat model in process to attach adapters to."
            )
        raise invalid_request(f"No in-process chat model named {model!r}.", param="model")

    def _pool(self) -> PoolHost:
        assert self.pool is not None, "_local answers None only with a pool"
        return self.pool


async def wait_released(done: Future[None], timeout_s: float) -> bool:
    """Whether the unload's future finished within `timeout_s` (asyncio.wait cancels nothing)."""
    finished, _ = await asyncio.wait({asyncio.wrap_future(done)}, timeout=max(0.0, timeout_s))
    return bool(finished)


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else "?"
