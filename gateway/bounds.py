"""Per-tenant bounds on what a tenant makes the server keep, and what a request to the routes over
stored state costs, so no tenant can crowd out another.

    bounds_of(settings, caller) -> Bounds     each bound from the caller's plan, else the setting
    exceeded(bound, limit, what, param)       the 400 that names the bound a request would pass
    take_request(tenancy, caller)             one request of the tenant's request budget and a
                                              concurrency lease (429 as chat's), released at the end

| bound (plan field = setting)   | what                                        | past it            |
|--------------------------------|---------------------------------------------|--------------------|
| `responses_max_stored`         | stored responses and conversations          | its LRU evicted    |
| `conversation_max_items`       | items of one conversation                   | 400                |
| `conversation_max_bytes`       | bytes of one conversation held whole        | 400                |
| `max_files`                    | files (uploads and batch outputs)           | 400                |
| `storage_quota_bytes`          | bytes of those files                        | 400                |
| `batch_max_open`               | batches not yet in a final status           | 400                |
| `batch_max_queued_lines`       | lines of those batches                      | 400                |
| `batch_max_running_per_tenant` | of them running at once on one gateway      | waits its turn     |
| `websocket_max_open`           | Responses WebSockets open on one gateway    | 429 at the upgrade |

`responses_max_stored` counts the records a tenant can read: a response kept only because later
ones continue it (format 2, gateway/responses/store.py) is stored once and not counted.

Batch outputs are written whatever the bounds say (the work is done and billed), but they count:
a tenant at its file bounds creates no batch. In open mode (no tenants) the settings apply to the
one tenant there is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.admission import Caller
from gateway.errors import APIError, ErrorKind
from gateway.settings import Settings

if TYPE_CHECKING:
    from tenancy.limiter import Lease
    from tenancy.service import Tenancy


@dataclass(frozen=True)
class Bounds:
    """One tenant's bounds (see the module docstring)."""

    responses_max_stored: int
    conversation_max_items: int
    conversation_max_bytes: int
    max_files: int
    storage_quota_bytes: int
    batch_max_open: int
    batch_max_queued_lines: int
    batch_max_running_per_tenant: int
    websocket_max_open: int


BOUND_NAMES = tuple(f.name for f in dataclasses.fields(Bounds))
# Each bound's error code (OpenAI has none for these; the message names the bound and its value).
_CODES = {
    "conversation_max_items": "conversation_too_large",
    "conversation_max_bytes": "conversation_too_large",
    "max_files": "file_limit_exceeded",
    "storage_quota_bytes": "storage_quota_exceeded",
    "batch_max_open": "batch_limit_exceeded",
    "batch_max_queued_lines": "batch_limit_exceeded",
}


def bounds_of(settings: Settings, caller: Caller | None) -> Bounds:
    """The bounds of `caller`'s tenant: its plan's, each one the plan does not set the setting's."""
    plan = caller.tenant.plan if caller is not None and caller.tenant is not None else None
    values = {}
    for name in BOUND_NAMES:
        own = getattr(plan, name, None) if plan is not None else None
        values[name] = int(own) if own is not None else int(getattr(settings, name))
    return Bounds(**values)


def exceeded(bound: str, limit: int, what: str, param: str | None = None) -> APIError:
    """The 400 for a request that would take the tenant past `bound` (`limit`): `what` says how."""
    unit = " bytes" if bound.endswith("_bytes") else ""
    return APIError(
        ErrorKind.INVALID_REQUEST,
        f"{what}: over your plan's {bound} of {limit:,}{unit}.",
        param=param,
        code=_CODES.get(bound, "limit_exceeded"),
    )


class RequestHold:
    """A stored-state request's hold on its tenant's request budget and concurrency: `release()`
    once it ends (idempotent; nothing is settled, it used no tokens)."""

    def __init__(self, tenancy: Tenancy | None = None, lease: Lease | None = None) -> None:
        self._tenancy = tenancy
        self._lease = lease

    async def release(self) -> None:
        tenancy, lease = self._tenancy, self._lease
        self._tenancy = self._lease = None
        if tenancy is not None and lease is not None:
            await tenancy.release(lease)


async def take_request(
    tenancy: Tenancy | None, caller: Caller, request_id: str
) -> tuple[RequestHold, dict[str, str]]:
    """One request of `caller`'s tenant's request budget and a concurrency lease, and the
    `x-ratelimit-*` headers; APIError 429 (`rate_limit_exceeded`, Retry-After) as chat's, or 503
    when the limiter is unavailable. Nothing to take in open mode or for a gateway in front."""
    if tenancy is None or caller.tenant is None or caller.internal:
        return RequestHold(), {}
    decision = await tenancy.take_request(caller.tenant, request_id)
    if not decision.admitted:
        unavailable = str(getattr(decision.reason, "value", decision.reason)) == "unavailable"
        raise APIError(
            ErrorKind.UNAVAILABLE if unavailable else ErrorKind.RATE_LIMITED,
            decision.message(),
            headers=decision.headers(),
            retry_after_s=(decision.retry_after_s or 1.0) if unavailable else None,
        )
    assert decision.lease is not None  # an admitted decision carries its lease
    return RequestHold(tenancy, decision.lease), decision.headers()
