"""The admin API: plans, tenants, prices, keys and budgets at run time, over `tenancy.admin.AdminStore`.

    GET    /admin/plans                      every plan (the file's, with run-time changes)
    GET    /admin/plans/{name}
    PUT    /admin/plans/{name}               body: the plan's table as JSON (the tenants file's fields)
    DELETE /admin/plans/{name}
    GET    /admin/tenants                    (the same four for tenants; budgets are their
    GET    /admin/tenants/{name}              budget_* fields, and a tenant's budgets' state
    PUT    /admin/tenants/{name}              comes with GET)
    DELETE /admin/tenants/{name}
    GET    /admin/prices                     every model's price (USD per 1M tokens, as in the file)
    GET    /admin/prices/{model}             (a model's name may hold "/")
    PUT    /admin/prices/{model}             body: the [prices."model"] table as JSON; the next request
    DELETE /admin/prices/{model}             of that model reserves and pays the new price
    GET    /admin/tenants/{name}/keys        hashes and metadata only
    POST   /admin/tenants/{name}/keys        body: {"name", "expires_at": unix s, "budgets"}; 201 with the
                                             raw key, shown this once
    POST   /admin/keys/{key_hash}/rotate     a new key (same tenant, name, expiry, budgets); the old revoked
    PUT    /admin/keys/{key_hash}/budgets    body: the key's own budget_* fields ({} removes them)
    DELETE /admin/keys/{key_hash}            revoke
    GET    /admin/audit?limit=100            the newest changes: who, what, when

Every route needs the admin key (`--admin-key-hash`; a tenant's key is a 401) and Redis (where
the changes live; every gateway picks them up within a second). A change the tenants file's
rules refuse is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admission
from gateway.errors import APIError, ErrorKind, invalid_request
from tenancy.admin import AdminStore, NotFoundError
from tenancy.errors import LimiterUnavailableError, TenancyConfigError, UnknownTenantError
from tenancy.keys import key_id_of
from tenancy.service import Tenancy


class AdminRoutes:
    """The admin endpoints over one `tenancy.Tenancy`."""

    def __init__(self, tenancy: Tenancy | None, admin_key_hash: str | None) -> None:
        self.tenancy = tenancy
        self.admin_key_hash = admin_key_hash

    def routes(self) -> list[Route]:
        return [
            Route("/admin/plans", self._wrap(self.list_plans), methods=["GET"]),
            Route("/admin/plans/{name}", self._wrap(self.plan), methods=["GET", "PUT", "DELETE"]),
            Route("/admin/tenants", self._wrap(self.list_tenants), methods=["GET"]),
            Route("/admin/tenants/{name}", self._wrap(self.tenant), methods=["GET", "PUT", "DELETE"]),
            Route("/admin/tenants/{name}/keys", self._wrap(self.tenant_keys), methods=["GET", "POST"]),
            Route("/admin/prices", self._wrap(self.list_prices), methods=["GET"]),
            Route("/admin/prices/{name:path}", self._wrap(self.price), methods=["GET", "PUT", "DELETE"]),
            Route("/admin/keys/{key_hash}/rotate", self._wrap(self.rotate_key), methods=["POST"]),
            Route("/admin/keys/{key_hash}/budgets", self._wrap(self.key_budgets), methods=["PUT"]),
            Route("/admin/keys/{key_hash}", self._wrap(self.revoke_key), methods=["DELETE"]),
            Route("/admin/audit", self._wrap(self.audit), methods=["GET"]),
        ]

    def _wrap(self, handler: Any) -> Any:
        async def handle(request: Request) -> Response:
            admission.check_admin(self.admin_key_hash, request.headers)
            store = self._store()

            try:
                response: Response = await handler(request, store)
                return response
            except (NotFoundError, UnknownTenantError) as exc:
                raise APIError(ErrorKind.NOT_FOUND, str(exc).strip("'\"")) from None
            except TenancyConfigError as exc:
                raise invalid_request(str(exc)) from None
            except LimiterUnavailableError as exc:
                raise APIError(ErrorKind.UNAVAILABLE, str(exc), retry_after_s=1.0) from None

        return handle

    def _store(self) -> AdminStore:
        if self.tenancy is None or self.tenancy.admin is None:
            raise APIError(
                ErrorKind.NOT_FOUND,
                "The admin API needs tenancy with Redis (--tenants and --redis-url): changes live in Redis.",
            )
        return self.tenancy.admin

    def _apply(self, config: Any) -> None:
        """This gateway serves a change at once; the others within their next poll."""
        assert self.tenancy is not None
        self.tenancy.reconfigure(config)

    @staticmethod
    def _actor(request: Request) -> str:
        client = request.client.host if request.client is not None else "?"
        return f"admin@{client}"

    # -- plans and tenants -------------------------------------------------------------------

    async def list_plans(self, request: Request, store: AdminStore) -> Response:
        config = await store.config()
        return JSONResponse({"object": "list", "data": [_plan_body(n, config) for n in sorted(config.plans)]})

    async def _change(self, request: Request, store: AdminStore, noun: str) -> Any:
        """GET, PUT or DELETE one plan, tenant or price (``noun``), served here at once: the
        configuration after it (a Response for a DELETE)."""
        name = request.path_params["name"]
        if request.method == "PUT":
            config = await getattr(store, f"put_{noun}")(name, await _json(request), self._actor(request))
        elif request.method == "DELETE":
            self._apply(await getattr(store, f"delete_{noun}")(name, self._actor(request)))
            return JSONResponse({"object": f"{noun}.deleted", "id": name, "deleted": True})
        else:
            return await store.config()
        self._apply(config)
        return config

    async def plan(self, request: Request, store: AdminStore) -> Response:
        name = request.path_params["name"]
        config = await self._change(request, store, "plan")
        if isinstance(config, Response):
            return config
        if name not in config.plans:
            raise APIError(ErrorKind.NOT_FOUND, f"no plan named {name!r}")
        return JSONResponse(_plan_body(name, config))

    async def list_tenants(self, request: Request, store: AdminStore) -> Response:
        config = await store.config()
        data = [_tenant_body(n, config) for n in sorted(config.tenants)]
        return JSONResponse({"object": "list", "data": data})

    async def tenant(self, request: Request, store: AdminStore) -> Response:
        name = request.path_params["name"]
        config = await self._change(request, store, "tenant")
        if isinstance(config, Response):
            return config
        tenant = config.tenant(name)
        if tenant is None:
            raise APIError(ErrorKind.NOT_FOUND, f"no tenant named {name!r}")
        body = _tenant_body(name, config)
        assert self.tenancy is not None
        body["budgets"] = [s.body() for s in await self.tenancy.limiter.budgets(name, tenant.budgets)]
        return JSONResponse(body)

    async def list_prices(self, request: Request, store: AdminStore) -> Response:
        prices = (await store.config()).source["prices"]
        return JSONResponse({"object": "list", "data": [_price_body(n, prices[n]) for n in sorted(prices)]})

    async def price(self, request: Request, store: AdminStore) -> Response:
        name = request.path_params["name"]
        config = await self._change(request, store, "price")
        if isinstance(config, Response):
            return config
        if name not in config.source["prices"]:
            raise APIError(ErrorKind.NOT_FOUND, f"no price for model {name!r}")
        return JSONResponse(_price_body(name, config.source["prices"][name]))

    # -- keys --------------------------------------------------------------------------------

    async def tenant_keys(self, request: Request, store: AdminStore) -> Response:
        import time

        name = request.path_params["name"]
        if request.method == "GET":
            keys = await store.keys(name)
            if not keys and (await store.config()).tenant(name) is None:
                raise APIError(ErrorKind.NOT_FOUND, f"no tenant named {name!r}")
            now = time.time()
            return JSONResponse({"object": "list", "data": [k.body(now) for k in keys]})
        body = await _object(request, ("name", "expires_at", "budgets"))
        expires_at = _expires_at(body)
        label = body.get("name", "")
        if not isinstance(label, str):
            raise invalid_request("name must be a string", "name")
        budgets = body.get("budgets")
        if budgets is not None and not isinstance(budgets, dict):
            raise invalid_request("budgets must be an object of budget_* fields", "budgets")
        issued = await store.issue_key(
            name, self._actor(request), name=label, expires_at=expires_at, budgets=budgets
        )
        return _issued(issued, label, expires_at)

    async def key_budgets(self, request: Request, store: AdminStore) -> Response:
        import time

        body = await _json(request)
        if not isinstance(body, dict):
            raise invalid_request("The body must be a JSON object of budget_* fields.")
        info = await store.set_key_budgets(request.path_params["key_hash"], body, self._actor(request))
        return JSONResponse(info.body(time.time()))

    async def rotate_key(self, request: Request, store: AdminStore) -> Response:
        expires_at = _expires_at(await _object(request, ("expires_at",)))
        issued = await store.rotate_key(
            request.path_params["key_hash"], self._actor(request), expires_at=expires_at
        )
        return _issued(issued, "", expires_at)

    async def revoke_key(self, request: Request, store: AdminStore) -> Response:
        info = await store.revoke_key(request.path_params["key_hash"], self._actor(request))
        return JSONResponse(
            {"object": "key.revoked", "key_id": info.key_id, "tenant": info.tenant, "revoked": True}
        )

    async def audit(self, request: Request, store: AdminStore) -> Response:
        try:
            limit = min(1000, max(1, int(request.query_params.get("limit", "100"))))
        except ValueError:
            raise invalid_request("limit must be an integer", "limit") from None
        return JSONResponse({"object": "list", "data": await store.audit(limit)})


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:
        raise invalid_request("The body must be JSON.") from None


async def _object(request: Request, fields: tuple[str, ...]) -> dict[str, Any]:
    """An optional JSON object body (empty: {}) of only ``fields``; else a 400 naming the problem."""
    body = await _json(request) if await request.body() else {}
    if not isinstance(body, dict):
        raise invalid_request("The body must be a JSON object.")
    extra = sorted(set(body) - set(fields))
    if extra:
        raise invalid_request(f"Unknown field {extra[0]!r} (expected {', '.join(fields)}).", extra[0])
    return body


def _expires_at(body: dict[str, Any]) -> float | None:
    expires_at = body.get("expires_at")
    if expires_at is not None and (not isinstance(expires_at, int | float) or isinstance(expires_at, bool)):
        raise invalid_request("expires_at must be Unix seconds", "expires_at")
    return expires_at


def _issued(issued: Any, name: str, expires_at: Any) -> Response:

    body = {
        "object": "key",
        "key": issued.raw_key,  # shown this once; only its hash is stored
        "key_hash": issued.key_hash,
        "key_id": key_id_of(issued.key_hash),
        "tenant": issued.tenant,
        "name": name,
        "expires_at": expires_at,
    }
    return JSONResponse(body, status_code=201, headers={"cache-control": "no-store"})


def _plan_body(name: str, config: Any) -> dict[str, Any]:
    return {"object": "plan", "id": name, **config.source["plans"][name]}


def _price_body(model: str, table: dict[str, Any]) -> dict[str, Any]:
    return {"object": "price", "id": model, **table}


def _tenant_body(name: str, config: Any) -> dict[str, Any]:
    table = dict(config.source["tenants"][name])
    table.pop("keys", None)  # hashes, listed by the keys route with their metadata
    return {"object": "tenant", "id": name, **table}
