"""The ``Tenancy`` facade: what the gateway calls, in request order.

::

    tenancy = Tenancy.from_settings(tenants_file, redis_url, redis_policy)
    tenant = await tenancy.authenticate(request.headers.get("authorization"))   # AuthError -> 401
    prompt_tokens = tenancy.tokens.count_messages(body.messages)                  # or exact count
    decision = await tenancy.admit(tenant, prompt_tokens, max_tokens, request_id, model=m, key_id=k)
    if not decision.admitted: ...  # 429 (or 503 for Reason.UNAVAILABLE), decision.headers()
    async with tenancy.hold(decision.lease) as held:   # renews the lease, settles on exit
        ... run / stream the request ...
        held.record(prompt_tokens=p, completion_tokens=c, cached_tokens=cached)

Budgets (the tenant's, from the tenants file) are reserved by ``admit`` at the request's worst
case at its model's price, and charged with the real cost when the hold settles; settlement
also writes the hourly ledger, read back with :meth:`Tenancy.ledger`.

The engine never sees tenants: the gateway passes ``tenant.plan.priority`` and
``tenant.plan.queue_deadline_seconds`` along with the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tenancy.admin import AdminStore
from tenancy.billing import Budget, BudgetState, Charge
from tenancy.config import OPEN_PLAN, OPEN_TENANT, TenancyConfig, Tenant, key_budgets, load_config
from tenancy.errors import AuthError, TenancyConfigError
from tenancy.keys import KeyStore, hash_key, key_id_of
from tenancy.ledger import DEFAULT_RETENTION_S, LEDGER_FILE, LedgerQuery, LedgerRow, MemoryStore, Sums
from tenancy.limiter import DEFAULT_LEASE_TTL_S, Decision, FailurePolicy, Lease, Limiter, MemoryLimiter
from tenancy.redis_limiter import RedisLimiter
from tenancy.tokens import TokenCounter, Tokenize
from tenancy.usage import TenantUsage

logger = logging.getLogger("batchgate.tenancy")

Sleep = Callable[[float], Awaitable[None]]

MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
INVALID_KEY_MESSAGE = "Incorrect API key provided."

# Settles (and cancelled renewers) still running after their request's task moved on or was
# cancelled; kept referenced so they are not garbage-collected mid-flight.
_background: set[asyncio.Future[Any]] = set()


def _keep_until_done(future: asyncio.Future[Any]) -> None:
    _background.add(future)
    future.add_done_callback(_background.discard)


class LeaseHolder:
    """Keeps an admitted request's lease alive while it runs and settles it exactly once.

    Use as ``async with``: on entry a background task renews the lease every ``ttl / 3``; on
    exit (normal, error or cancellation) renewal stops and the lease is settled with what
    :meth:`record` last received. Nothing recorded means nothing used: the whole reservation
    is refunded. The settlement is on its way when :meth:`settle` (or :meth:`close`) returns,
    and answered in the background (``Limiter.settle_nowait``): whatever this process admits or
    reads after it sees it; ``Tenancy.aclose`` waits for those still in flight.
    """

    def __init__(self, limiter: Limiter, lease: Lease, *, sleep: Sleep = asyncio.sleep) -> None:
        self.lease = lease
        self._limiter = limiter
        self._sleep = sleep
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._cached_tokens = 0
        self._renewer: asyncio.Task[None] | None = None
        self._settled = False

    def record(
        self,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """Set the usage to settle with (each value replaces the previous one; ``cached_tokens``
        are the prompt tokens served from the prefix cache, part of ``prompt_tokens``)."""
        if prompt_tokens is not None:
            self._prompt_tokens = prompt_tokens
        if completion_tokens is not None:
            self._completion_tokens = completion_tokens
        if cached_tokens is not None:
            self._cached_tokens = cached_tokens

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Micro-dollars these tokens cost at the request's model's price."""
        return self.lease.charge.cost(prompt_tokens, cached_tokens, completion_tokens)

    async def __aenter__(self) -> LeaseHolder:
        if self._settled or self._renewer is not None:
            raise RuntimeError("a LeaseHolder can be entered only once")
        if self.lease.tracked:
            self._renewer = asyncio.create_task(self._renew_forever(), name=f"renew-{self.lease.request_id}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """:meth:`settle` (the context manager's exit)."""
        self.settle()

    def settle(self) -> None:
        """Stop renewing and send the settlement with what :meth:`record` last received
        (idempotent); its answer is not waited for."""
        if self._settled:
            return
        self._settled = True
        if self._renewer is not None:
            # No need to wait for it: a renew that lands after the settle finds no lease.
            self._renewer.cancel()
            _keep_until_done(self._renewer)
        _keep_until_done(
            self._limiter.settle_nowait(
                self.lease, self._prompt_tokens, self._completion_tokens, self._cached_tokens
            )
        )

    async def _renew_forever(self) -> None:
        interval = self.lease.ttl_s / 3
        warned = False
        while True:
            await self._sleep(interval)
            if not await self._limiter.renew(self.lease) and not warned:
                warned = True
                logger.warning("tenancy: lease of %s could not be renewed", self.lease.request_id)


@dataclass(frozen=True)
class Identity:
    """Who a request's key belongs to, and which key it is (``key_id``: ``key_`` and the first
    16 hex digits of its hash; a ledger dimension, never the key)."""

    tenant: Tenant
    key_id: str = ""
    key_budgets: tuple[Budget, ...] = ()  # the key's own budgets (set through the admin API)


class Tenancy:
    """Authentication, admission and settlement for the gateway, over one :class:`Limiter`."""

    def __init__(
        self,
        config: TenancyConfig,
        limiter: Limiter,
        *,
        open_mode: bool = False,
        keys: KeyStore | None = None,
        tokens: TokenCounter | None = None,
        sleep: Sleep = asyncio.sleep,
        admin: AdminStore | None = None,
    ) -> None:
        self.config = config
        self.admin = admin  # run-time plans, tenants and keys (with Redis); see tenancy.admin
        self.limiter = limiter
        self.tokens = tokens or TokenCounter()
        self._open_mode = open_mode
        self._keys = keys or KeyStore(config)
        self._sleep = sleep

    @classmethod
    def from_settings(
        cls,
        tenants_file: str | None,
        redis_url: str | None,
        redis_policy: str = "fail_closed",
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        tokenize: Tokenize | None = None,
        storage_dir: str | Path | None = None,
        retention_s: float = DEFAULT_RETENTION_S,
    ) -> Tenancy:
        """Build from the gateway's settings; fails early on a bad file or policy.

        No ``tenants_file``: open mode (one tenant ``default``, no key, no limits). No
        ``redis_url``: in-memory limits for this process only, with budgets' use and the ledger
        in ``storage_dir``'s SQLite file (kept across restarts; in memory without one).
        ``tokenize`` is the local model's tokenizer (text -> ids), if any. ``retention_s``: how
        long the ledger keeps an hour. Raises TenancyConfigError / ValueError. Opens no
        connection yet: Redis may come up after the gateway.
        """
        policy = FailurePolicy.parse(redis_policy)
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s: must be > 0, got {lease_ttl_s}")
        if tenants_file is None:
            config = TenancyConfig(plans={OPEN_PLAN.name: OPEN_PLAN}, tenants={OPEN_TENANT.name: OPEN_TENANT})
        else:
            config = load_config(tenants_file)
        limiter: Limiter
        keys: KeyStore
        if redis_url:
            redis_limiter = RedisLimiter.from_url(
                redis_url, policy=policy, lease_ttl_s=lease_ttl_s, retention_s=retention_s
            )
            limiter = redis_limiter
            keys = KeyStore(config, redis_limiter.client, policy=policy)
            admin = None if tenants_file is None else AdminStore(redis_limiter.client, config)
        else:
            path = None if storage_dir is None else Path(storage_dir) / LEDGER_FILE
            store = MemoryStore(path, retention_s=retention_s)
            limiter = MemoryLimiter(lease_ttl_s=lease_ttl_s, store=store)
            keys = KeyStore(config)
            admin = None
        return cls(
            config,
            limiter,
            open_mode=tenants_file is None,
            keys=keys,
            tokens=TokenCounter(tokenize),
            admin=admin,
        )

    def reconfigure(self, config: TenancyConfig) -> None:
        """Serve ``config`` from the next request on (plans, tenants, budgets, static keys)."""
        self.config = config
        self._keys.reconfigure(config)

    @property
    def open_mode(self) -> bool:
        """True without a tenants file: every request is tenant ``default``, unlimited."""
        return self._open_mode

    async def authenticate(self, authorization_header: str | None) -> Tenant:
        """The tenant of ``Authorization: Bearer <key>``.

        Raises :class:`AuthError` (-> 401 ``invalid_api_key``) for a missing, malformed,
        unknown or revoked key, and :class:`LimiterUnavailableError` (-> 503) when Redis is
        needed for the lookup, unreachable, and the policy is ``fail_closed``. In open mode
        the header is ignored.
        """
        return (await self.identify(authorization_header)).tenant

    async def identify(self, authorization_header: str | None) -> Identity:
        """:meth:`authenticate`, with the id of the key used (empty in open mode)."""
        if self._open_mode:
            return Identity(OPEN_TENANT)
        raw_key = _bearer_token(authorization_header)
        tenant, meta = await self._keys.resolve_key(raw_key)
        if tenant is None:
            raise AuthError(INVALID_KEY_MESSAGE)
        key_id = key_id_of(hash_key(raw_key))
        budgets: tuple[Budget, ...] = ()
        if isinstance(meta.get("budgets"), dict):
            try:
                budgets = key_budgets(meta["budgets"], key_id)
            except TenancyConfigError as exc:  # written by an older or foreign tool: not enforced
                logger.error("tenancy: key %s has invalid budgets (%s); ignored", key_id, exc)
        return Identity(tenant, key_id, budgets)

    def tenant_names(self) -> list[str]:
        """Every configured tenant's name (sorted)."""
        return sorted(self.config.tenants)

    def budgets_of(self, tenant: Tenant) -> tuple[Budget, ...]:
        """The budgets that apply to ``tenant``'s requests."""
        return tenant.budgets

    async def admit(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        max_tokens: int,
        request_id: str,
        *,
        model: str = "",
        key_id: str = "",
        key_budgets: tuple[Budget, ...] = (),
        batch: bool = False,
    ) -> Decision:
        """Reserve ``prompt_tokens + max_tokens``, one request and one lease for ``tenant``,
        and the request's worst case (at ``model``'s price) against each of its budgets.

        Never raises for Redis trouble: the policy's answer comes back as the Decision
        (``Reason.UNAVAILABLE``). Refused -> 429 with ``decision.headers()`` (503 when the
        reason is UNAVAILABLE; ``insufficient_quota`` for ``Reason.BUDGET``); admitted -> hold
        ``decision.lease`` with :meth:`hold`. ``key_budgets``: the key's own
        (``Identity.key_budgets``), held beside the tenant's.
        """
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got prompt={prompt_tokens} max={max_tokens}")
        charge = Charge.worst_case(
            self.budgets_of(tenant) + key_budgets,
            num_prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            model=model,
            key_id=key_id,
            price=self.config.price(model),
            batch=batch,
        )
        return await self.limiter.admit(
            tenant.name, tenant.plan, prompt_tokens + max_tokens, request_id, charge
        )

    async def take_request(self, tenant: Tenant, request_id: str) -> Decision:
        """One request of ``tenant``'s request budget and a concurrency lease, no tokens and no
        budget: what a request to the routes over stored state (conversations, files, batches)
        costs. Refused as :meth:`admit` refuses; admitted -> :meth:`release` the lease when the
        request ends (nothing is settled: it used no tokens and is no model request)."""
        return await self.limiter.admit(tenant.name, tenant.plan, 0, request_id)

    async def release(self, lease: Lease) -> None:
        """End a lease of :meth:`take_request` (never raises; see ``Limiter.release``)."""
        await self.limiter.release(lease)

    def hold(self, lease: Lease) -> LeaseHolder:
        """An async context manager that renews ``lease`` while the request runs and settles it."""
        return LeaseHolder(self.limiter, lease, sleep=self._sleep)

    async def settle(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> bool:
        """Settle ``lease`` directly (prefer :meth:`hold`); see ``Limiter.settle``."""
        return await self.limiter.settle(lease, prompt_tokens, completion_tokens, cached_tokens)

    async def usage(self) -> dict[str, TenantUsage]:
        """Prompt/completion tokens and requests per tenant (LimiterUnavailableError if Redis is away)."""
        return await self.limiter.usage()

    async def budget_states(self, tenant: Tenant) -> list[BudgetState]:
        """``tenant``'s budgets now: use and holds in the current window (LimiterUnavailableError
        if Redis is away)."""
        return await self.limiter.budgets(tenant.name, self.budgets_of(tenant))

    async def ledger(self, tenants: list[str], start_hour: int, end_hour: int) -> list[LedgerRow]:
        """The ledger's rows of ``tenants`` for hours ``[start_hour, end_hour)`` since the epoch."""
        return await self.limiter.ledger(tenants, start_hour, end_hour)

    async def usage_sums(self, tenants: list[str], query: LedgerQuery) -> Sums:
        """The ledger of ``tenants`` summed as ``query`` asks (LimiterUnavailableError if Redis
        is away)."""
        return await self.limiter.usage_sums(tenants, query)

    def on_soft_limit(self, callback: Callable[[str, Budget], None]) -> None:
        """Call ``callback(tenant, budget)`` when a settlement crosses a budget's soft threshold
        (once per window and budget)."""
        self.limiter.on_soft_limit = callback

    async def ready(self) -> bool:
        """Whether admission can currently enforce limits (Redis answers PING, or no Redis).

        A PING that answers also retries the settlements kept during an outage."""
        if not isinstance(self.limiter, RedisLimiter):
            return True
        return await self.limiter.ping()

    @property
    def redis_up(self) -> bool | None:
        """Whether the last call reached Redis (the ``batchgate_redis_up`` gauge); None without
        Redis, or before the first call."""
        if not isinstance(self.limiter, RedisLimiter):
            return None
        return self.limiter.reachable

    async def aclose(self) -> None:
        """Release connections (wait for settles still in flight first)."""
        if _background:
            await asyncio.gather(*_background, return_exceptions=True)
        await self.limiter.aclose()


def _bearer_token(header: str | None) -> str:
    if header is None or not header.strip():
        raise AuthError(MISSING_KEY_MESSAGE)
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError(MISSING_KEY_MESSAGE)
    return token
