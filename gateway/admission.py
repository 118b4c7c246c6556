"""The seam between the gateway and `tenancy`: authenticate, admit, settle.

Open mode (no tenancy object) admits everything as one anonymous caller at paid priority; with a
`tenancy.Tenancy`, each request is authenticated to a tenant, admitted against its limits, and
its lease is held (renewed, then settled with the tokens really used) until the response ends:

    parse -> authenticate -> tokenize -> admit -> submit -> stream/gather -> settle (Admission.close)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.types import Priority
from gateway.errors import APIError, ErrorKind
from tenancy.admin import ConfigWatcher
from tenancy.config import Tenant
from tenancy.errors import AuthError, LimiterUnavailableError
from tenancy.redis_limiter import RedisLimiter
from tenancy.service import LeaseHolder, Tenancy

logger = logging.getLogger("batchgate.gateway")

# How often the limiter's store (Redis) is pinged in the background: keeps the
# batchgate_redis_up gauge current and retries the settlements kept during an outage even when
# no request comes.
LIMITER_PROBE_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Caller:
    """Who is asking, as far as the engine cares: fairness key, priority and queue deadline."""

    name: str
    priority: Priority = Priority.PAID
    queue_deadline_s: float | None = None
    tenant: Tenant | None = None  # when tenancy is on
    plan: str = "open"  # metrics label: "paid", "free" or "open" (never a tenant-chosen string)
    internal: bool = False  # admitted by a gateway in front of this replica; do not admit again
    report_usage: bool = False  # that gateway wants a stream's final usage chunk
    key_id: str = ""  # the API key's ledger id (`key_` + 16 hex digits of its hash), never the key
    key_budgets: tuple[Any, ...] = ()  # the key's own budgets (tenancy.billing.Budget)
    # Set by a gateway in front (pool mode), so what runs here never exceeds what it reserved:
    upstream_request_id: str = ""  # its request id: this replica keeps the usage for it to read
    max_tokens_cap: int | None = None  # completion tokens per choice it reserved
    prompt_tokens_held: int | None = None  # prompt tokens it held against a hard budget
    prompt_excess_weight: int = 1  # completion tokens that pay for one prompt token past that

    @property
    def cache_salt(self) -> str:
        """Prefix-cache namespace: each tenant its own, so no tenant can time another's prompts;
        one shared namespace in open mode (no tenants, one trust domain)."""
        return "" if self.plan == "open" else self.name


OPEN_CALLER = Caller(name="")

# Gateway -> replica headers (gateway-only mode). The replica trusts them only with the token.
INTERNAL_HEADER = "x-batchgate-internal"
PRIORITY_HEADER = "x-batchgate-priority"
DEADLINE_HEADER = "x-batchgate-deadline"
PLAN_HEADER = "x-batchgate-plan"
FAIRNESS_HEADER = "x-batchgate-fairness"
# A gateway asks for a stream's final usage chunk with this (to settle the exact token count).
USAGE_HEADER = "x-batchgate-usage"
# What the gateway reserved, so the replica stays within it, and the id under which the replica
# keeps the request's final usage (read at /v1/internal/usage/{id} when a stream was cut short).
REQUEST_ID_HEADER = "x-batchgate-request-id"
MAX_TOKENS_HEADER = "x-batchgate-max-tokens"
# The prompt tokens held against a hard budget (the gateway's estimate): a longer exact prompt
# takes its excess out of the completion tokens, so the request never costs more than its hold.
PROMPT_TOKENS_HEADER = "x-batchgate-prompt-tokens"
PROMPT_WEIGHT_HEADER = "x-batchgate-prompt-weight"  # tenancy.billing.prompt_excess_weight
PATH_HEADER = "x-batchgate-path"  # the endpoint a `POST /v1/internal/count` body is for


_PRIORITIES = {p.name.lower(): p for p in Priority}  # the priority header's values


def _positive_int(raw: str | None) -> int | None:
    try:
        value = int(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def _token_matches(token: str | None, headers: Mapping[str, str]) -> bool:
    given = headers.get(INTERNAL_HEADER)
    if not token or given is None:
        return False
    return hmac.compare_digest(given.encode(), token.encode())


def check_internal(token: str | None, headers: Mapping[str, str], *, closed: bool = False) -> None:
    """Internal endpoints: the token is required (401); with no token configured, open, unless
    `closed` (tenants are configured: then nobody may call them)."""
    if (token or closed) and not _token_matches(token, headers):
        message = "This endpoint needs the internal token (--internal-token)."
        raise APIError(ErrorKind.INVALID_API_KEY, message)


def has_tenants(tenancy: Tenancy | None) -> bool:
    """Whether tenants are configured (a tenants file): the internal routes are closed then."""
    return tenancy is not None and not tenancy.open_mode


ADMIN_KEY_MISSING = "The admin API needs the admin key (Authorization: Bearer <admin key>)."
ADMIN_OFF = "The admin API is off: start the gateway with --admin-key-hash."


def check_admin(admin_key_hash: str | None, headers: Mapping[str, str]) -> None:
    """Admin routes: the bearer token must hash to `admin_key_hash` (401 otherwise: a tenant's
    key is no admin key; no admin key configured, every call is a 401)."""
    if not admin_key_hash:
        raise APIError(ErrorKind.INVALID_API_KEY, ADMIN_OFF)
    scheme, _, token = (headers.get("authorization") or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIError(ErrorKind.INVALID_API_KEY, ADMIN_KEY_MISSING)
    given = "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()
    if not hmac.compare_digest(given.encode(), admin_key_hash.encode()):
        raise APIError(ErrorKind.INVALID_API_KEY, "Incorrect admin key provided.")


def internal_caller(token: str | None, headers: Mapping[str, str], user: str | None) -> Caller | None:
    """The caller a gateway vouched for (priority and deadline from its headers), or None."""
    if not _token_matches(token, headers):
        return None
    priority = _PRIORITIES.get(headers.get(PRIORITY_HEADER, "paid").lower(), Priority.PAID)
    deadline: float | None = None
    try:
        raw = headers.get(DEADLINE_HEADER)
        deadline = float(raw) if raw else None
        if deadline is not None and not (deadline > 0 and deadline < 1e9):
            deadline = None
    except ValueError:
        deadline = None
    plan = headers.get(PLAN_HEADER, "open").lower()
    return Caller(
        name=headers.get(FAIRNESS_HEADER, user or "")[:200],
        priority=priority,
        queue_deadline_s=deadline,
        plan=plan if plan in ("paid", "free", "open") else "open",
        internal=True,
        report_usage=headers.get(USAGE_HEADER) == "1",
        upstream_request_id=headers.get(REQUEST_ID_HEADER, "")[:200],
        max_tokens_cap=_positive_int(headers.get(MAX_TOKENS_HEADER)),
        prompt_tokens_held=_positive_int(headers.get(PROMPT_TOKENS_HEADER)),
        prompt_excess_weight=_positive_int(headers.get(PROMPT_WEIGHT_HEADER)) or 1,
    )


class Admission:
    """One admitted request's hold on its tenant's limits; `close()` settles it (idempotent)."""

    def __init__(self, holder: LeaseHolder | None = None, headers: dict[str, str] | None = None) -> None:
        self._holder = holder
        self.headers = dict(headers or {})  # x-ratelimit-* for the response

    def record(
        self,
        *,
        num_prompt_tokens: int | None = None,
        num_completion_tokens: int | None = None,
        num_cached_tokens: int | None = None,
    ) -> None:
        if self._holder is not None:
            self._holder.record(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=num_completion_tokens,
                cached_tokens=num_cached_tokens,
            )

    def cost(self, num_prompt_tokens: int, num_cached_tokens: int, num_completion_tokens: int) -> int:
        """Micro-dollars these tokens cost at the request's model's price (0 without tenancy)."""
        if self._holder is None:
            return 0
        return self._holder.cost(num_prompt_tokens, num_cached_tokens, num_completion_tokens)

    def settle(self) -> None:
        """Send the settlement with the usage recorded (once; not waited for: whatever this
        gateway admits or reads afterwards sees it, see tenancy.redis_limiter)."""
        if self._holder is not None:
            self._holder.settle()

    async def close(self) -> None:
        self.settle()


async def authenticate(tenancy: Tenancy | None, authorization: str | None, user: str | None) -> Caller:
    """The caller of a request; APIError 401 for a bad key, 503 when the key store is unreachable."""
    if tenancy is None:
        # Open mode: the OpenAI `user` field is the only identity there is; use it for fairness.
        return Caller(name=user or "")
    try:
        identity = await tenancy.identify(authorization)
    except AuthError as exc:
        raise APIError(ErrorKind.INVALID_API_KEY, str(exc)) from None
    except LimiterUnavailableError as exc:
        raise APIError(
            ErrorKind.UNAVAILABLE, f"Authentication is unavailable: {exc}", retry_after_s=1.0
        ) from None
    return tenant_caller(identity.tenant, identity.key_id, identity.key_budgets)


def tenant_caller(tenant: Tenant, key_id: str = "", key_budgets: tuple[Any, ...] = ()) -> Caller:
    """The caller of an authenticated tenant's request, at its plan's priority."""
    plan = tenant.plan
    return Caller(
        name=tenant.name,
        priority=Priority.FREE if plan.priority == "free" else Priority.PAID,
        queue_deadline_s=plan.queue_deadline_seconds,
        tenant=tenant,
        plan="free" if plan.priority == "free" else "paid",
        key_id=key_id,
        key_budgets=key_budgets,
    )


async def admit(
    tenancy: Tenancy | None,
    caller: Caller,
    *,
    num_prompt_tokens: int,
    max_num_tokens: int,
    request_id: str,
    model: str = "",
    batch: bool = False,
) -> Admission:
    """Reserve the request's tokens and its worst-case cost against its budgets; APIError 429
    (`insufficient_quota` for a budget; 503 when the limiter is unavailable) if refused."""
    if tenancy is None:
        return Admission()
    if caller.tenant is None:
        raise RuntimeError("admit() needs an authenticated caller when tenancy is on")
    decision = await tenancy.admit(
        caller.tenant,
        num_prompt_tokens,
        max_num_tokens,
        request_id,
        model=model,
        key_id=caller.key_id,
        key_budgets=caller.key_budgets,
        batch=batch,
    )
    if not decision.admitted:
        reason = str(getattr(decision.reason, "value", decision.reason))
        unavailable = reason == "unavailable"
        kind = ErrorKind.RATE_LIMITED
        if unavailable:
            kind = ErrorKind.UNAVAILABLE
        elif reason == "budget":
            kind = ErrorKind.INSUFFICIENT_QUOTA
        error = APIError(
            kind,
            decision.message(),
            headers=decision.headers(),
            retry_after_s=(decision.retry_after_s or 1.0) if unavailable else None,
        )
        refusal = getattr(decision, "budget", None)
        if refusal is not None:
            error.budget = (
                refusal.budget.metric,
                "key" if refusal.budget.scope.startswith("key") else "tenant",
            )
        raise error
    assert decision.lease is not None  # an admitted decision carries its lease
    holder = tenancy.hold(decision.lease)
    await holder.__aenter__()
    # Nothing is recorded yet: a request the engine refuses is refunded whole.
    return Admission(holder, decision.headers())


@contextlib.asynccontextmanager
async def watching(
    tenancy: Tenancy | None, interval_s: float = LIMITER_PROBE_INTERVAL_S
) -> AsyncIterator[None]:
    """While inside, ping ``tenancy``'s limiter every ``interval_s`` (see LIMITER_PROBE_INTERVAL_S),
    and follow the plans and tenants changed at run time (tenancy.admin: a first read before
    serving, then a poll); nothing without tenancy or without Redis."""
    if tenancy is None or not _uses_redis(tenancy):
        yield
        return
    followers: list[asyncio.Future[None]] = []
    admin_store = tenancy.admin
    if admin_store is not None:
        watcher = ConfigWatcher(admin_store, tenancy.reconfigure)
        await watcher.check()
        followers.append(asyncio.ensure_future(watcher.run()))

    async def probe() -> None:
        while True:
            try:
                await tenancy.ready()
            except Exception:  # noqa: BLE001 - a probe must never end the loop
                logger.exception("probing the rate limiter failed")
            await asyncio.sleep(interval_s)

    tasks = [asyncio.ensure_future(probe()), *followers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _uses_redis(tenancy: Tenancy) -> bool:

    return isinstance(getattr(tenancy, "limiter", None), RedisLimiter)
