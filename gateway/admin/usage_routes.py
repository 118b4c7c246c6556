"""Reading the usage ledger over HTTP: a tenant's own, and every tenant's for the operator.

    GET /v1/usage                            a tenant's key: its buckets, its budgets' state and its
                                             bounds with their use (`limits`: gateway/bounds.py)
    GET /v1/organization/usage/completions   the admin key: OpenAI's organization Usage API shape,
                                             every tenant (`project_id` is the tenant)
    GET /admin/usage.csv                     the admin key: the same rows as CSV, one per bucket
                                             and group

Query parameters as OpenAI's: `start_time` (Unix seconds, inclusive; default: 24 hours ago),
`end_time` (exclusive; default: now), `bucket_width` `1h` or `1d` (default `1d`), `group_by`
(repeated or comma-separated: `model`, `api_key_id`, `batch`, and for the admin `project_id`),
and the admin's filters `project_ids`, `models`, `api_key_ids`. Buckets are aligned to the width
in UTC; the ledger's resolution is the hour.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway import admission
from gateway.errors import APIError, ErrorKind, invalid_request
from tenancy.errors import LimiterUnavailableError
from tenancy.ledger import LedgerQuery, Sums, page
from tenancy.service import Tenancy

BUCKET_WIDTHS = {"1h": 3600, "1d": 86400}
# Most buckets one query may ask for: two months of hours, a year and a month of days.
MAX_BUCKETS = {"1h": 24 * 62, "1d": 400}
TENANT_GROUPS = ("model", "api_key_id", "batch")
ADMIN_GROUPS = ("project_id", *TENANT_GROUPS)
CSV_COLUMNS = (
    "start_time",
    "end_time",
    "project_id",
    "model",
    "api_key_id",
    "batch",
    "num_model_requests",
    "input_tokens",
    "input_cached_tokens",
    "output_tokens",
    "cost_micros",
)


def _values(request: Request, name: str) -> list[str]:
    """A list parameter given as `name=a&name=b`, `name[]=a` or `name=a,b`."""
    raw = request.query_params.getlist(name) + request.query_params.getlist(name + "[]")
    return [v.strip() for item in raw for v in item.split(",") if v.strip()]


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid_request(f"{name} must be Unix seconds (an integer), got {raw!r}", name) from None
    if value < 0:
        raise invalid_request(f"{name} must be >= 0, got {value}", name)
    return value


class Query:
    """One validated usage query."""

    def __init__(self, request: Request, groups: Sequence[str], *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        width_name = request.query_params.get("bucket_width", "1d")
        if width_name not in BUCKET_WIDTHS:
            raise invalid_request(
                f"bucket_width must be one of {', '.join(BUCKET_WIDTHS)} (the ledger is hourly), "
                f"got {width_name!r}",
                "bucket_width",
            )
        self.width_s = BUCKET_WIDTHS[width_name]
        self.end_time = _int_param(request, "end_time", math.ceil(now))
        self.start_time = _int_param(request, "start_time", self.end_time - 86400)
        if self.start_time >= self.end_time:
            raise invalid_request("start_time must be before end_time", "start_time")
        first = self.start_time - self.start_time % self.width_s
        if (self.end_time - first) / self.width_s > MAX_BUCKETS[width_name]:
            raise invalid_request(
                f"at most {MAX_BUCKETS[width_name]} buckets of {width_name} per query", "start_time"
            )
        self.group_by = _values(request, "group_by")
        for group in self.group_by:
            if group not in groups:
                raise invalid_request(
                    f"group_by must be among {', '.join(groups)}, got {group!r}", "group_by"
                )
        self.models = set(_values(request, "models"))
        self.api_key_ids = set(_values(request, "api_key_ids"))

    def ledger_query(self) -> LedgerQuery:
        """What the store sums: the hours from the first bucket's start, by bucket and group."""

        first = self.start_time - self.start_time % self.width_s
        return LedgerQuery(
            first // 3600,
            math.ceil(self.end_time / 3600),
            self.width_s // 3600,
            tuple(self.group_by),
            frozenset(self.models),
            frozenset(self.api_key_ids),
        )

    def buckets(self, sums: Sums) -> list[dict[str, Any]]:

        return page(
            sums,
            start_time=self.start_time,
            end_time=self.end_time,
            bucket_width_s=self.width_s,
            group_by=self.group_by,
        )


def _page(data: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"object": "page", "data": data, "has_more": False, "next_page": None, **extra}


def _unavailable(exc: Exception) -> APIError:
    return APIError(ErrorKind.UNAVAILABLE, f"The usage ledger is unavailable: {exc}", retry_after_s=1.0)


class UsageRoutes:
    """The usage endpoints over one `tenancy.Tenancy` (None: open mode, where they answer 404)."""

    def __init__(
        self,
        tenancy: Tenancy | None,
        admin_key_hash: str | None,
        limits: Callable[[admission.Caller], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.tenancy = tenancy
        self.admin_key_hash = admin_key_hash
        self.limits = limits  # a caller's tenant's bounds and their use now

    def _tenancy(self) -> Tenancy:
        if self.tenancy is None:
            raise APIError(ErrorKind.NOT_FOUND, "Usage is recorded only when tenancy is on (--tenants).")
        return self.tenancy

    async def own(self, request: Request) -> Response:
        """`GET /v1/usage`: the calling tenant's buckets and budgets."""
        tenancy = self._tenancy()
        caller = await admission.authenticate(tenancy, request.headers.get("authorization"), None)
        assert caller.tenant is not None
        query = Query(request, TENANT_GROUPS)

        try:
            sums = await tenancy.usage_sums([caller.tenant.name], query.ledger_query())
            states = await tenancy.budget_states(caller.tenant)
        except LimiterUnavailableError as exc:
            raise _unavailable(exc) from None
        body = _page(query.buckets(sums), budgets=[s.body() for s in states])
        if self.limits is not None:
            body["limits"] = await self.limits(caller)
        for bucket in body["data"]:
            for result in bucket["results"]:
                result["object"] = "usage.completions.result"
                result.pop("project_id", None)
        return _json(body)

    async def _admin_sums(self, request: Request) -> tuple[Query, Sums]:
        tenancy = self._tenancy()
        admission.check_admin(self.admin_key_hash, request.headers)
        query = Query(request, ADMIN_GROUPS)
        wanted = set(_values(request, "project_ids"))
        tenants = sorted(wanted or tenancy.tenant_names())

        try:
            return query, await tenancy.usage_sums(tenants, query.ledger_query())
        except LimiterUnavailableError as exc:
            raise _unavailable(exc) from None

    async def organization(self, request: Request) -> Response:
        """`GET /v1/organization/usage/completions`: every tenant, in OpenAI's shape."""
        query, sums = await self._admin_sums(request)
        return _json(_page(query.buckets(sums)))

    async def csv_export(self, request: Request) -> Response:
        """`GET /admin/usage.csv`: the same buckets, one CSV row per bucket and group."""
        query, sums = await self._admin_sums(request)
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for bucket in query.buckets(sums):
            for result in bucket["results"]:
                row = {**result, "start_time": bucket["start_time"], "end_time": bucket["end_time"]}
                writer.writerow(["" if row.get(c) is None else row[c] for c in CSV_COLUMNS])
        return Response(out.getvalue(), media_type="text/csv")


def _json(body: dict[str, Any]) -> Response:
    """A usage page as JSON by orjson: a 30-day hourly page holds thousands of results, which the
    stdlib's encoder writes several times slower (docs/BENCHMARKS.md, the ledger figures)."""
    return Response(orjson.dumps(body), media_type="application/json")
