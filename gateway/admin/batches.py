"""Every tenant's batches, for the operator (the admin key), over the tenants' own batch routes.

    GET  /admin/batches                      ?tenant, status, limit (1-100, default 20): the newest
                                             batches of every tenant (or one), newest first
    GET  /admin/batches/{batch_id}           ?tenant (optional: found among every tenant's)
    POST /admin/batches/{batch_id}/cancel    ?tenant; as the tenant's own cancel: `cancelling`, then
                                             `cancelled` once its lines in flight end

Each batch is answered as `/v1/batches` answers it, with `tenant` added. Retrieve and cancel run
the tenant's own handlers (gateway/batches/api.py) as that tenant, so an admin's cancel is exactly
a tenant's. The batches live where the Batch API keeps them (Redis or the storage directory), so
these routes need no Redis: only the admin key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admission
from gateway.batches.api import Batches, public
from gateway.errors import APIError, ErrorKind, invalid_request

MAX_LIMIT, DEFAULT_LIMIT = 100, 20


class AdminBatches:
    """The admin's batch routes over the Batch API's `Batches`; `tenant_names()`: every tenant
    whose batches there are to list (open mode: the one open caller, "")."""

    def __init__(
        self, batches: Batches, admin_key_hash: str | None, tenant_names: Callable[[], list[str]]
    ) -> None:
        self.batches = batches
        self.admin_key_hash = admin_key_hash
        self.tenant_names = tenant_names

    def routes(self) -> list[Route]:
        return [
            Route("/admin/batches", self.list_all, methods=["GET"]),
            Route("/admin/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/admin/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    def _tenants(self, request: Request) -> list[str]:
        admission.check_admin(self.admin_key_hash, request.headers)
        tenant = request.query_params.get("tenant")
        names = self.tenant_names()
        if tenant is None:
            return names
        if tenant not in names:
            raise APIError(ErrorKind.NOT_FOUND, f"No tenant named {tenant!r}.")
        return [tenant]

    async def list_all(self, request: Request) -> Response:
        tenants = self._tenants(request)
        try:
            limit = int(request.query_params.get("limit", DEFAULT_LIMIT))
        except ValueError:
            raise invalid_request("limit must be an integer", "limit") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise invalid_request(f"limit must be between 1 and {MAX_LIMIT}", "limit")
        status = request.query_params.get("status")
        rows: list[dict[str, Any]] = []
        for tenant in tenants:
            # Each tenant's newest first; a status filter reads its whole list (the store has
            # no index by status), the others only what the page can show.
            page = await self.batches.store.list_batches(
                tenant, after=None, limit=1_000_000 if status else limit + 1
            )
            rows += [{**public(b), "tenant": tenant} for b in page if status in (None, b["status"])]
        rows.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)
        data = rows[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(rows) > limit,
            }
        )

    async def _owner(self, request: Request) -> admission.Caller:
        """The caller who owns the path's batch (a 404 when no tenant has it)."""
        batch_id = request.path_params["batch_id"]
        for tenant in self._tenants(request):
            if await self.batches.store.get_batch(tenant, batch_id) is not None:
                return admission.Caller(name=tenant)
        raise APIError(ErrorKind.NOT_FOUND, f"No batch found with id '{batch_id}'.")

    async def retrieve(self, request: Request) -> Response:
        owner = await self._owner(request)
        return _with_tenant(await self.batches.retrieve(owner, request), owner.name)

    async def cancel(self, request: Request) -> Response:
        owner = await self._owner(request)
        return _with_tenant(await self.batches.cancel(owner, request), owner.name)


def _with_tenant(response: Response, tenant: str) -> Response:
    """The tenant route's answer (a JSON batch) with its owner added."""
    body = orjson.loads(bytes(response.body))
    return JSONResponse({**body, "tenant": tenant}, status_code=response.status_code)
