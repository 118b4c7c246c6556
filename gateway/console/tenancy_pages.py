"""The console's pages over the admin API's tenancy (it needs Redis): tenants and plans with their
limits, priorities and budgets, keys, prices, and the audit log.

    GET  /ui/tenants, /ui/tenants/{name}     list with each tenant's spend against its budgets; edit
    POST /ui/tenants/save, /ui/tenants/delete                    PUT, DELETE /admin/tenants/{name}
    GET  /ui/plans, /ui/plans/{name}
    POST /ui/plans/save, /ui/plans/delete                        PUT, DELETE /admin/plans/{name}
    GET  /ui/keys?tenant=                    every key (ids and hashes), an issue form
    POST /ui/keys/issue, /ui/keys/rotate     the new raw key is shown on the answer, once
    POST /ui/keys/revoke                                         DELETE /admin/keys/{hash}
    GET  /ui/prices?model=
    POST /ui/prices/save, /ui/prices/delete                      PUT, DELETE /admin/prices/{model}
    GET  /ui/audit?limit=
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from starlette.responses import Response

from gateway.console import forms
from gateway.console.calls import ApiError, segment
from gateway.console.page import Page


@functools.cache
def _fields(schema: str) -> list[forms.Field]:
    return forms.fields_of(schema)


async def _name(page: Page, field: str = "name") -> str:
    return forms.required(await page.form(), field)


async def _exists(page: Page, path: str) -> bool:
    try:
        await page.api.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise
    return True


# -- tenants -------------------------------------------------------------------------------------


async def tenants(page: Page) -> Response:
    listed, plans = await asyncio.gather(page.api.get("/admin/tenants"), page.api.get("/admin/plans"))
    names = [t["id"] for t in listed["data"]]
    details = await asyncio.gather(*(page.api.get(f"/admin/tenants/{segment(n)}") for n in names))
    return page.render(
        "tenants.html",
        tenants=details,
        plans=[p["id"] for p in plans["data"]],
        fields=_fields("TenantTable"),
        values={},
    )


async def tenant(page: Page) -> Response:
    name = page.request.path_params["name"]
    body, plans = await asyncio.gather(
        page.api.get(f"/admin/tenants/{segment(name)}"), page.api.get("/admin/plans")
    )
    return page.render(
        "tenant.html",
        tenant=body,
        plans=[p["id"] for p in plans["data"]],
        fields=_fields("TenantTable"),
        values=body,
    )


async def save_tenant(page: Page) -> Response:
    return await _save(page, "tenants", "tenant", "TenantTable")


async def delete_tenant(page: Page) -> Response:
    return await _delete(page, "tenants", "tenant")


# -- plans ---------------------------------------------------------------------------------------


async def plans(page: Page) -> Response:
    listed = await page.api.get("/admin/plans")
    return page.render("plans.html", plans=listed["data"], fields=_fields("PlanTable"), values={})


async def plan(page: Page) -> Response:
    body = await page.api.get(f"/admin/plans/{segment(page.request.path_params['name'])}")
    return page.render("plan.html", plan=body, fields=_fields("PlanTable"), values=body)


async def save_plan(page: Page) -> Response:
    return await _save(page, "plans", "plan", "PlanTable")


async def delete_plan(page: Page) -> Response:
    return await _delete(page, "plans", "plan")


# -- a named tenant or plan, created, changed or deleted through the admin API ------------------


async def _save(page: Page, kind: str, label: str, table_name: str) -> Response:
    """Create (the form's `create=1`) or change the `kind` named in the form, from its fields."""
    page.back = f"/ui/{kind}"
    name = await _name(page)
    table = forms.table_from_form(_fields(table_name), await page.form())
    path = f"/admin/{kind}/{segment(name)}"
    creating = (await page.form()).get("create") == "1"
    if creating and await _exists(page, path):
        return page.refused(f"A {label} named {name!r} exists already: edit it instead.")
    page.back = f"/ui/{kind}" if creating else f"/ui/{kind}/{segment(name)}"
    await page.api.put(path, table)
    done = "created" if creating else "saved"
    return page.done(f"{label.capitalize()} {name} {done}.", f"/ui/{kind}/{segment(name)}")


async def _delete(page: Page, kind: str, label: str) -> Response:
    page.back = f"/ui/{kind}"
    name = await _name(page)
    await page.api.delete(f"/admin/{kind}/{segment(name)}")
    return page.done(f"{label.capitalize()} {name} deleted.")


# -- keys ----------------------------------------------------------------------------------------


async def keys(page: Page, issued: dict[str, Any] | None = None) -> Response:
    listed = await page.api.get("/admin/tenants")
    names = [t["id"] for t in listed["data"]]
    chosen = page.request.query_params.get("tenant") or (issued or {}).get("tenant") or ""
    shown = [chosen] if chosen in names else names
    pages = await asyncio.gather(*(page.api.get(f"/admin/tenants/{segment(n)}/keys") for n in shown))
    rows = [key for listing in pages for key in listing["data"]]
    return page.render("keys.html", tenants=names, chosen=chosen, keys=rows, issued=issued, now=time.time())


async def issue_key(page: Page) -> Response:
    page.back = "/ui/keys"
    form = await page.form()
    tenant = await _name(page, "tenant")
    body: dict[str, Any] = {"name": str(form.get("name") or "").strip()}
    days = str(form.get("expires_in_days") or "").strip()
    if days:
        body["expires_at"] = time.time() + 86400 * forms.Field(
            "expires_in_days", "Expires in days", "number", False, exclusive_minimum=0
        ).parse(days)
    issued = await page.api.post(f"/admin/tenants/{segment(tenant)}/keys", body)
    return await keys(page, issued)


async def rotate_key(page: Page) -> Response:
    page.back = "/ui/keys"
    key_hash = await _name(page, "key_hash")
    issued = await page.api.post(f"/admin/keys/{segment(key_hash)}/rotate")
    return await keys(page, issued)


async def revoke_key(page: Page) -> Response:
    page.back = "/ui/keys"
    key_hash = await _name(page, "key_hash")
    revoked = await page.api.delete(f"/admin/keys/{segment(key_hash)}")
    return page.done(
        f"Key {revoked['key_id']} of {revoked['tenant']} revoked.",
        f"/ui/keys?tenant={segment(revoked['tenant'])}",
    )


# -- prices --------------------------------------------------------------------------------------


async def prices(page: Page) -> Response:
    listed = await page.api.get("/admin/prices")
    model = page.request.query_params.get("model", "")
    values: dict[str, Any] = next((p for p in listed["data"] if p["id"] == model), {})
    return page.render(
        "prices.html", prices=listed["data"], fields=_fields("PriceTable"), model=model, values=values
    )


async def save_price(page: Page) -> Response:
    page.back = "/ui/prices"
    model = await _name(page, "model")
    table = forms.table_from_form(_fields("PriceTable"), await page.form())
    await page.api.put(f"/admin/prices/{segment(model)}", table)
    return page.done(f"The price of {model} saved: it applies from the next request.")


async def delete_price(page: Page) -> Response:
    page.back = "/ui/prices"
    model = await _name(page, "model")
    await page.api.delete(f"/admin/prices/{segment(model)}")
    return page.done(f"The price of {model} deleted.")


# -- the audit log -------------------------------------------------------------------------------


async def audit(page: Page) -> Response:
    limit = page.request.query_params.get("limit", "100")
    listed = await page.api.get("/admin/audit", {"limit": limit})
    return page.render("audit.html", entries=listed["data"], limit=limit)
