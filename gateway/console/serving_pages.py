"""The console's pages over what is served (no Redis needed): usage from the ledger, the live
state, every tenant's batches, LoRA adapters.

    GET  /ui/usage?width=&range=&by=&tenant=&model=   charts and totals from
                                                      /v1/organization/usage/completions
    GET  /ui/usage.csv?...                            the same query from /admin/usage.csv
    GET  /ui/live, /ui/live/panel                     the panel refreshes itself every 2 s (htmx):
                                                      /health, /ready, /admin/engines,
                                                      /admin/replicas and /metrics (gateway/console/live.py)
    GET  /ui/batches?tenant=&status=, /ui/batches/{batch_id}?tenant=
    POST /ui/batches/cancel                           POST /admin/batches/{id}/cancel
    GET  /ui/adapters
    POST /ui/adapters/load, /ui/adapters/unload       PUT, DELETE /admin/loras/{name}
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from gateway.console import forms, live
from gateway.console.calls import ApiError, segment
from gateway.console.page import Page, utc

WIDTHS = {"1h": "hour", "1d": "day"}
RANGES = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
SERIES = {"tenant": "project_id", "model": "model"}
# What each usage chart shows, from one result of the usage API.
METRICS: dict[str, tuple[str, Callable[[dict[str, Any]], float]]] = {
    "tokens": ("Tokens (input + output)", lambda r: r["input_tokens"] + r["output_tokens"]),
    "requests": ("Requests", lambda r: r["num_model_requests"]),
    "cost": ("Cost (USD)", lambda r: r["cost_micros"] / 1e6),
}
FINAL = ("completed", "failed", "expired", "cancelled")


# -- usage ---------------------------------------------------------------------------------------


def _usage_query(page: Page) -> tuple[dict[str, str], dict[str, str | int]]:
    """The page's choices (each defaulted when absent or unknown) and the usage API's parameters."""
    q = page.request.query_params

    def pick(name: str, options: dict[str, Any], default: str) -> str:
        value = q.get(name, default)
        return value if value in options else default

    chosen = {
        "width": pick("width", WIDTHS, "1h"),
        "range": pick("range", RANGES, "24h"),
        "by": pick("by", SERIES, "tenant"),
        "tenant": q.get("tenant", "").strip(),
        "model": q.get("model", "").strip(),
    }
    end = math.ceil(time.time())
    params: dict[str, str | int] = {
        "start_time": end - RANGES[chosen["range"]],
        "end_time": end,
        "bucket_width": chosen["width"],
        "group_by": "project_id,model",
    }
    if chosen["tenant"]:
        params["project_ids"] = chosen["tenant"]
    if chosen["model"]:
        params["models"] = chosen["model"]
    return chosen, params


def charts(buckets: list[dict[str, Any]], width: str, by: str) -> dict[str, Any]:
    """The charts' data: a label per bucket, and per metric one series per tenant (or model)."""
    group = SERIES[by]
    names = sorted({str(r[group]) for b in buckets for r in b["results"]})
    out: dict[str, Any] = {"labels": [utc(b["start_time"], WIDTHS[width]) for b in buckets], "charts": {}}
    for metric, (title, value) in METRICS.items():
        datasets = [
            {
                "label": name,
                "data": [sum(value(r) for r in b["results"] if str(r[group]) == name) for b in buckets],
            }
            for name in names
        ]
        out["charts"][metric] = {"title": title, "datasets": datasets}
    return out


def totals(buckets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tenant and model, the whole range's sums."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for bucket in buckets:
        for r in bucket["results"]:
            row = rows.setdefault(
                (r["project_id"], r["model"]),
                {"tenant": r["project_id"], "model": r["model"], "requests": 0, "input": 0, "cached": 0}
                | {"output": 0, "cost_micros": 0},
            )
            row["requests"] += r["num_model_requests"]
            row["input"] += r["input_tokens"]
            row["cached"] += r["input_cached_tokens"]
            row["output"] += r["output_tokens"]
            row["cost_micros"] += r["cost_micros"]
    return [rows[key] for key in sorted(rows, key=lambda k: (str(k[0]), str(k[1])))]


async def usage(page: Page) -> Response:
    chosen, params = _usage_query(page)
    try:
        buckets = (await page.api.get("/v1/organization/usage/completions", params))["data"]
    except ApiError as exc:
        if exc.status != 404:
            raise
        return page.render("usage.html", chosen=chosen, unavailable=exc.message, data=None, rows=[], csv="")
    csv = "/ui/usage.csv?" + page.request.url.query
    return page.render(
        "usage.html",
        chosen=chosen,
        unavailable=None,
        data=charts(buckets, chosen["width"], chosen["by"]),
        rows=totals(buckets),
        csv=csv,
        ranges=RANGES,
    )


async def usage_csv(page: Page) -> Response:
    chosen, params = _usage_query(page)
    answer = await page.api.call("GET", "/admin/usage.csv", params=params)
    name = f"batchgate-usage-{chosen['width']}-{params['start_time']}-{params['end_time']}.csv"
    disposition = f'attachment; filename="{name}"'
    return Response(answer.content, media_type="text/csv", headers={"content-disposition": disposition})


# -- live ----------------------------------------------------------------------------------------


async def _live_state(page: Page, readings: live.Readings, clock: Callable[[], float]) -> dict[str, Any]:
    health, ready = await page.api.probe("/health"), await page.api.probe("/ready")
    engines = (await page.api.get("/admin/engines"))["data"]
    replicas = (await page.api.get("/admin/replicas"))["data"]
    metrics = (await page.api.call("GET", "/metrics")).text
    summary = readings.add(live.parse(metrics, clock()))
    return {
        "health": health,
        "ready": ready,
        "engines": engines,
        "replicas": replicas,
        "summary": summary,
        "updated": time.strftime("%H:%M:%S UTC", time.gmtime()),
    }


async def live_page(page: Page, readings: live.Readings, clock: Callable[[], float]) -> Response:
    return page.render("live.html", **await _live_state(page, readings, clock))


async def live_panel(page: Page, readings: live.Readings, clock: Callable[[], float]) -> Response:
    return page.render("_live_panel.html", **await _live_state(page, readings, clock))


# -- batches -------------------------------------------------------------------------------------


async def batches(page: Page) -> Response:
    q = page.request.query_params
    params: dict[str, str | int] = {"limit": 100}
    for name in ("tenant", "status"):
        if q.get(name):
            params[name] = q[name]
    listed = await page.api.get("/admin/batches", params)
    return page.render(
        "batches.html",
        batches=listed["data"],
        has_more=listed["has_more"],
        tenant=q.get("tenant", ""),
        status=q.get("status", ""),
        final=FINAL,
    )


async def batch(page: Page) -> Response:
    batch_id = page.request.path_params["batch_id"]
    tenant = page.request.query_params.get("tenant")
    params = {"tenant": tenant} if tenant is not None else None
    body = await page.api.get(f"/admin/batches/{segment(batch_id)}", params)
    return page.render("batch.html", batch=body, final=FINAL)


async def cancel_batch(page: Page) -> Response:
    page.back = "/ui/batches"
    form = await page.form()
    batch_id, tenant = forms.required(form, "batch_id"), str(form.get("tenant") or "")
    body = await page.api.post(f"/admin/batches/{segment(batch_id)}/cancel", params={"tenant": tenant})
    return page.done(f"Batch {batch_id} of {tenant or 'the open tenant'}: {body['status']}.")


# -- adapters ------------------------------------------------------------------------------------


async def adapters(page: Page) -> Response:
    listed = await page.api.get("/admin/loras")
    return page.render("adapters.html", adapters=listed["data"], bytes_held=listed["bytes_held"])


async def load_adapter(page: Page) -> Response:
    page.back = "/ui/adapters"
    form = await page.form()
    name = forms.required(form, "name")
    body = {
        "path": forms.required(form, "path"),
        "tenant": str(form.get("tenant") or "").strip() or None,
        "model": str(form.get("model") or "").strip() or None,
    }
    loaded = await page.api.put(f"/admin/loras/{segment(name)}", body)
    return page.done(f"Adapter {name} loaded (version {loaded['version']}).")


async def unload_adapter(page: Page) -> Response:
    page.back = "/ui/adapters"
    name = forms.required(await page.form(), "name")
    answer = await page.api.delete(f"/admin/loras/{segment(name)}")
    freed = "its memory freed" if answer.get("released") else "its memory freed once its last request ends"
    return page.done(f"Adapter {name} unloaded, {freed}.")
