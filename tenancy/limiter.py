"""Admission control: the ``Limiter`` interface, its typed results, and the in-memory backend.

``admit`` reserves ``tokens`` from the tenant's token bucket, one request from its request
bucket and one concurrency lease, all or nothing (the arithmetic is in ``tenancy.bucket``).
Each tenant has two lanes of these: interactive requests, under the plan's ``tokens_per_minute``,
``requests_per_minute`` and ``max_concurrent_requests``, and the Batch API's lines (a charge with
``batch``), under ``batch_tokens_per_minute`` and ``batch_max_concurrent_lines`` only (no request
rate), so a running batch takes nothing of the tenant's interactive limits. Budgets are one pool:
both lanes' holds count against them.
The caller then runs the request, calls ``renew`` every ``lease_ttl_s / 3`` while it runs, and
``settle`` once when it ends, which refunds the tokens reserved but not used and releases the
lease. ``tenancy.service.LeaseHolder`` does the renew/settle part for the gateway.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tenancy.billing import NO_CHARGE, Budget, BudgetRefusal, BudgetState, Charge, window_index
from tenancy.bucket import (
    BucketState,
    Limits,
    Reason,
    Step,
    admission_step,
    refilled,
    refund,
    remaining,
    seconds_to_full,
)
from tenancy.config import Plan
from tenancy.ledger import HOUR_S, BudgetUpdate, LedgerQuery, LedgerRow, MemoryStore, Sums
from tenancy.usage import MemoryUsage, TenantUsage

DEFAULT_LEASE_TTL_S = 60.0


class FailurePolicy(enum.StrEnum):
    """What admission answers when the limiter's store (Redis) cannot be reached."""

    FAIL_CLOSED = "fail_closed"  # refuse with Reason.UNAVAILABLE (the gateway answers 503)
    FAIL_OPEN = "fail_open"  # admit without limits and log a warning

    @classmethod
    def parse(cls, value: str | FailurePolicy) -> FailurePolicy:
        """The policy named ``value``; ValueError naming the setting otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"redis_policy: must be 'fail_closed' or 'fail_open', got {value!r}") from None


@dataclass(frozen=True)
class Lease:
    """One admitted request's hold on a concurrency slot and on its reserved tokens.

    ``expires_at`` is in the store's clock (Redis ``TIME`` for Redis). ``limits`` are those
    the lease was admitted under (the refund is capped at that capacity). An untracked lease
    (``limits`` None: open mode, or admitted by ``fail_open`` during an outage) holds nothing
    in the store: settling it only counts usage (and charges budgets and the ledger), renewing
    it is a no-op. ``charge`` says what the request costs and which budgets hold its worst case.
    """

    lease_id: str
    tenant: str
    request_id: str
    reserved_tokens: int
    ttl_s: float
    expires_at: float
    limits: Limits | None = None
    charge: Charge = NO_CHARGE

    @property
    def tracked(self) -> bool:
        return self.limits is not None


@dataclass(frozen=True)
class Decision:
    """The answer to one admission.

    ``admitted`` is what the caller acts on; ``reason`` says why (``Reason.UNAVAILABLE`` with
    ``admitted=True`` means "let through by fail_open during an outage"). ``retry_after_s`` is
    > 0 only for a refusal that waiting can cure. The ``limit_*``, ``remaining_*`` and
    ``reset_*`` fields feed OpenAI's ``x-ratelimit-*`` headers and are None when no limit
    applies (open mode, or the store unavailable). ``lease`` is set exactly when admitted.
    """

    admitted: bool
    reason: Reason
    retry_after_s: float = 0.0
    limit_requests: int | None = None
    limit_tokens: int | None = None
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    lease: Lease | None = None
    requested_tokens: int = 0
    budget: BudgetRefusal | None = None  # set for Reason.BUDGET

    def __post_init__(self) -> None:
        assert self.admitted == (self.lease is not None), "a lease is held exactly when admitted"

    def headers(self) -> dict[str, str]:
        """OpenAI-style rate-limit headers, plus ``retry-after``/``retry-after-ms`` on a
        refusal that waiting cures (the openai SDK honours both)."""
        headers: dict[str, str] = {}
        if self.limit_requests is not None and self.limit_tokens is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s or 0.0)
            headers["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s or 0.0)
        if self.reason is Reason.BUDGET:
            # Waiting seconds does not help: the openai SDK would otherwise retry a 429 twice.
            headers["x-should-retry"] = "false"
        elif not self.admitted and self.retry_after_s > 0:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers

    def message(self) -> str:
        """A sentence for the error body of a refusal (empty when admitted)."""
        if self.admitted:
            return ""
        wait = f" Please try again in {format_duration(self.retry_after_s)}."
        if self.reason is Reason.BUDGET and self.budget is not None:
            return self.budget.message()
        if self.reason is Reason.TOO_LARGE:
            return (
                f"Request too large: it needs {self.requested_tokens} tokens (prompt + max_tokens), "
                f"more than the plan's limit of {self.limit_tokens} tokens per minute. "
                "Reduce the prompt or max_tokens."
            )
        if self.reason is Reason.TOKENS:
            return (
                f"Rate limit reached for tokens per minute: limit {self.limit_tokens}, "
                f"remaining {self.remaining_tokens}, requested {self.requested_tokens}." + wait
            )
        if self.reason is Reason.REQUESTS:
            return f"Rate limit reached for requests per minute: limit {self.limit_requests}." + wait
        if self.reason is Reason.CONCURRENCY:
            return "Too many concurrent requests for this API key's plan." + wait
        return "The rate limiter is unavailable; the request was not admitted. Please retry shortly."


def format_duration(seconds: float) -> str:
    """A Go-style duration as OpenAI writes reset headers: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def limits_of(plan: Plan) -> Limits | None:
    """The plan's limits, or None for an unlimited plan."""
    if plan.unlimited:
        return None
    if (
        plan.tokens_per_minute is None
        or plan.requests_per_minute is None
        or plan.max_concurrent_requests is None
    ):
        raise ValueError(f"plan {plan.name!r}: limits must be all set or all unset")
    return Limits(plan.tokens_per_minute, plan.requests_per_minute, plan.max_concurrent_requests)


# A batch lane limit the plan does not set: never reached (exact in a double, as Lua needs).
UNLIMITED = 10**15


def lane_limits(plan: Plan, batch: bool) -> Limits | None:
    """The limits of the plan's interactive lane, or of its batch lane (module docstring); None
    for an unlimited plan (both lanes untracked)."""
    limits = limits_of(plan)
    if limits is None or not batch:
        return limits
    return Limits(
        plan.batch_tokens_per_minute or UNLIMITED, UNLIMITED, plan.batch_max_concurrent_lines or UNLIMITED
    )


def new_lease_id() -> str:
    """A random lease id, unique across gateway processes."""
    return uuid.uuid4().hex


def untracked_decision(
    tenant: str,
    tokens: int,
    request_id: str,
    ttl_s: float,
    now: float,
    reason: Reason = Reason.OK,
    charge: Charge = NO_CHARGE,
) -> Decision:
    """An admission that holds nothing in the store (open mode, or fail_open)."""
    lease = Lease(new_lease_id(), tenant, request_id, 0, ttl_s, now + ttl_s, limits=None, charge=charge)
    return Decision(admitted=True, reason=reason, lease=lease, requested_tokens=tokens)


def decision_from_step(
    step: Step, limits: Limits, tokens: int, lease: Lease | None, budget: BudgetRefusal | None = None
) -> Decision:
    """Turn an admission step (and the lease taken, if admitted) into a :class:`Decision`."""
    return Decision(
        budget=budget,
        admitted=step.admitted,
        reason=step.reason,
        retry_after_s=step.retry_after_s,
        limit_requests=limits.requests_per_minute,
        limit_tokens=limits.tokens_per_minute,
        remaining_requests=remaining(step.request_level),
        remaining_tokens=remaining(step.token_level),
        reset_requests_s=seconds_to_full(
            step.request_level, limits.requests_per_minute, limits.requests_per_second
        ),
        reset_tokens_s=seconds_to_full(step.token_level, limits.tokens_per_minute, limits.tokens_per_second),
        lease=lease,
        requested_tokens=tokens,
    )


class Limiter(Protocol):
    """Admission control for tenants; one implementation per store.

    Contract: ``admit`` is atomic per tenant (no interleaving can over-admit), and reserves the
    charge's worst case against each of its budgets in the same step (``Reason.BUDGET`` when
    one cannot hold it); a refusal changes no state except pruning expired leases (and their
    budget holds). ``settle`` is called once per admitted lease, refunds ``reserved - used``
    tokens (capped at capacity) only while the lease is still live, releases it and its budget
    holds, and in the same step charges the real cost to the budgets and the hourly ledger and
    counts usage; it is idempotent on the lease's request id, and returns whether the lease
    was still live.
    ``renew`` pushes a live lease's expiry to ``now + ttl`` and returns False for a lease that
    is gone (settled or expired). ``settle``/``renew`` never raise for an unreachable store:
    they log and return False (the lease then expires by itself).
    """

    lease_ttl_s: float
    on_soft_limit: Callable[[str, Budget], None]  # called when a settle crosses a soft threshold

    async def admit(
        self, tenant: str, plan: Plan, tokens: int, request_id: str, charge: Charge = NO_CHARGE
    ) -> Decision: ...

    async def settle(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> bool: ...

    def settle_nowait(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> asyncio.Future[bool]:
        """``settle``, on its way when this returns: every ``admit`` and ``budgets`` of this
        limiter made after it sees it, and ``usage``/``ledger``/``usage_sums`` made after it wait
        for it; the future gives ``settle``'s answer (and never raises for an unreachable store)."""
        ...

    async def settled(self) -> None:
        """Return once every settlement sent so far has been answered (or kept for a retry)."""
        ...

    async def renew(self, lease: Lease) -> bool: ...

    async def release(self, lease: Lease) -> None:
        """Drop a live lease that reserved no tokens and no budget (a request to the routes over
        stored state: ``Tenancy.take_request``) without settling it: no refund, no budget charge,
        no ledger row. Never raises for an unreachable store (the lease then ends by its TTL)."""
        ...

    async def usage(self) -> dict[str, TenantUsage]: ...

    async def budgets(self, tenant: str, budgets: tuple[Budget, ...]) -> list[BudgetState]:
        """Each budget's use and holds in its current window."""
        ...

    async def ledger(self, tenants: list[str], start_hour: int, end_hour: int) -> list[LedgerRow]:
        """The ledger's rows of ``tenants`` for hours in ``[start_hour, end_hour)``."""
        ...

    async def usage_sums(self, tenants: list[str], query: LedgerQuery) -> Sums:
        """The ledger of ``tenants`` summed as ``query`` asks, by the store."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class _LaneState:
    tokens: BucketState | None = None
    requests: BucketState | None = None
    leases: dict[str, float] = field(default_factory=dict)  # lease_id -> expiry


@dataclass
class _TenantState:
    interactive: _LaneState = field(default_factory=_LaneState)
    batch: _LaneState = field(default_factory=_LaneState)
    holds: dict[str, list[tuple[str, int, int]]] | None = None  # lease_id -> (budget, window, amount)

    def lane(self, batch: bool) -> _LaneState:
        return self.batch if batch else self.interactive


def budget_store_key(tenant: str, budget: Budget) -> str:
    return f"{tenant}/{budget.name}"


def soft_threshold(budget: Budget) -> int | None:
    return None if budget.soft_ratio is None else math.floor(budget.limit * budget.soft_ratio)


class MemoryLimiter:
    """The :class:`Limiter` for a single process: rate limits and budget holds in dicts,
    budgets' use and the ledger in a :class:`~tenancy.ledger.MemoryStore` (SQLite: a file in the
    storage directory survives a restart), time from ``now``.

    Safe for one asyncio event loop (no await between check and reserve). ``now`` is
    injectable so tests move time by hand instead of sleeping; ``wall`` (Unix seconds) names
    budget windows and ledger hours (default: ``now`` when injected, else ``time.time``).
    """

    def __init__(
        self,
        *,
        now: Callable[[], float] = time.monotonic,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        store: MemoryStore | None = None,
        wall: Callable[[], float] | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._now = now
        self._wall = wall or (time.time if now is time.monotonic else now)
        self.lease_ttl_s = lease_ttl_s
        self._tenants: dict[str, _TenantState] = {}
        self._usage = MemoryUsage()
        self.store = store or MemoryStore()
        self.on_soft_limit: Callable[[str, Budget], None] = lambda tenant, budget: None

    def _live_leases(self, state: _TenantState, now: float, batch: bool = False) -> dict[str, float]:
        """The live leases of one lane, after pruning both lanes' expired leases and their holds."""
        for lane in (state.interactive, state.batch):
            lane.leases = {lid: exp for lid, exp in lane.leases.items() if exp > now}
        if state.holds:
            live = state.interactive.leases.keys() | state.batch.leases.keys()
            state.holds = {lid: h for lid, h in state.holds.items() if lid in live}
        return state.lane(batch).leases

    def _reserved(self, state: _TenantState, key: str, window: int) -> int:
        return sum(
            a for holds in (state.holds or {}).values() for k, w, a in holds if k == key and w == window
        )

    def _check_budgets(
        self, tenant: str, state: _TenantState, charge: Charge
    ) -> tuple[list[tuple[str, int, int]], BudgetRefusal | None]:
        wall = self._wall()
        holds = []
        for budget, amount in zip(charge.budgets, charge.reserved, strict=True):
            key = budget_store_key(tenant, budget)
            window = window_index(budget.window, wall)
            used = self.store.budget_used(key, window)
            reserved = self._reserved(state, key, window)
            if used + reserved + amount > budget.limit:
                return [], BudgetRefusal(budget, used, reserved, amount, window)
            holds.append((key, window, amount))
        return holds, None

    async def admit(
        self, tenant: str, plan: Plan, tokens: int, request_id: str, charge: Charge = NO_CHARGE
    ) -> Decision:
        now = self._now()
        limits = lane_limits(plan, charge.batch)
        if limits is None:
            return untracked_decision(tenant, tokens, request_id, self.lease_ttl_s, now, charge=charge)
        state = self._tenants.setdefault(tenant, _TenantState())
        leases = self._live_leases(state, now, charge.batch)
        lane = state.lane(charge.batch)
        step = admission_step(
            now=now,
            tokens=tokens,
            limits=limits,
            token_bucket=lane.tokens,
            request_bucket=lane.requests,
            num_leases=len(leases),
        )
        holds, refusal = self._check_budgets(tenant, state, charge)
        if refusal is not None:
            budget_step = Step(False, Reason.BUDGET, 0.0, step.token_level, step.request_level)
            if step.admitted:  # the levels after the step include this request: report them before
                budget_step = Step(
                    False, Reason.BUDGET, 0.0, step.token_level + tokens, step.request_level + 1
                )
            return decision_from_step(budget_step, limits, tokens, None, refusal)
        if not step.admitted:
            return decision_from_step(step, limits, tokens, None)
        lane.tokens = BucketState(step.token_level, now)
        lane.requests = BucketState(step.request_level, now)
        lease = Lease(
            new_lease_id(),
            tenant,
            request_id,
            tokens,
            self.lease_ttl_s,
            now + self.lease_ttl_s,
            limits,
            charge,
        )
        leases[lease.lease_id] = lease.expires_at
        if holds:
            state.holds = state.holds or {}
            state.holds[lease.lease_id] = holds
        return decision_from_step(step, limits, tokens, lease)

    async def settle(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> bool:
        return self._settle(lease, prompt_tokens, completion_tokens, cached_tokens)

    def settle_nowait(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> asyncio.Future[bool]:
        """Settled before this returns (in this process, in the store's file)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        done.set_result(self._settle(lease, prompt_tokens, completion_tokens, cached_tokens))
        return done

    async def settled(self) -> None:
        """At once: each settlement is made before `settle_nowait` returns."""

    def _settle(self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bool:
        now = self._now()
        wall = self._wall()
        state = self._tenants.get(lease.tenant)
        live = False
        holds: list[tuple[str, int, int]] = []
        if state is not None and lease.limits is not None:
            live = self._live_leases(state, now, lease.charge.batch).pop(lease.lease_id, None) is not None
            holds = (state.holds or {}).pop(lease.lease_id, [])
        charge = lease.charge
        admitted_in = {key: window for key, window, _ in holds}
        updates = []
        amounts = charge.amounts(prompt_tokens, cached_tokens, completion_tokens)
        for budget, amount in zip(charge.budgets, amounts, strict=True):
            key = budget_store_key(lease.tenant, budget)
            window = window_index(budget.window, wall)
            if admitted_in.get(key, window) == window:
                updates.append(BudgetUpdate(key, window, amount, soft_threshold(budget)))
        row = LedgerRow(
            lease.tenant,
            int(wall // HOUR_S),
            charge.model,
            charge.key_id,
            charge.batch,
            1,
            prompt_tokens,
            min(cached_tokens, prompt_tokens),
            completion_tokens,
            charge.cost(prompt_tokens, cached_tokens, completion_tokens),
        )
        duplicate, crossed = self.store.settle(lease.request_id, wall, row, updates)
        if duplicate:
            return False
        for index in crossed:
            budget = next(
                b for b in charge.budgets if budget_store_key(lease.tenant, b) == updates[index].key
            )
            self.on_soft_limit(lease.tenant, budget)
        self._usage.add(lease.tenant, prompt_tokens, completion_tokens)
        limits = lease.limits
        if limits is None or state is None:
            return False
        if live:
            lane = state.lane(lease.charge.batch)
            level = refilled(lane.tokens, now, limits.tokens_per_minute, limits.tokens_per_second)
            unused = lease.reserved_tokens - (prompt_tokens + completion_tokens)
            lane.tokens = BucketState(refund(level, unused, limits.tokens_per_minute), now)
        return live

    async def renew(self, lease: Lease) -> bool:
        if not lease.tracked:
            return True
        now = self._now()
        state = self._tenants.get(lease.tenant)
        if state is None:
            return False
        leases = self._live_leases(state, now, lease.charge.batch)
        if lease.lease_id not in leases:
            return False
        leases[lease.lease_id] = now + lease.ttl_s
        return True

    async def release(self, lease: Lease) -> None:
        state = self._tenants.get(lease.tenant)
        if state is not None and lease.tracked:
            state.lane(lease.charge.batch).leases.pop(lease.lease_id, None)

    async def usage(self) -> dict[str, TenantUsage]:
        return self._usage.snapshot()

    async def budgets(self, tenant: str, budgets: tuple[Budget, ...]) -> list[BudgetState]:
        wall = self._wall()
        state = self._tenants.get(tenant)
        if state is not None:
            self._live_leases(state, self._now())
        out = []
        for budget in budgets:
            key = budget_store_key(tenant, budget)
            window = window_index(budget.window, wall)
            reserved = 0 if state is None else self._reserved(state, key, window)
            out.append(BudgetState(budget, self.store.budget_used(key, window), reserved, window))
        return out

    async def ledger(self, tenants: list[str], start_hour: int, end_hour: int) -> list[LedgerRow]:
        return self.store.ledger(tenants, start_hour, end_hour)

    async def usage_sums(self, tenants: list[str], query: LedgerQuery) -> Sums:
        return self.store.sums(tenants, query)

    async def aclose(self) -> None:
        self.store.close()

    def num_leases(self, tenant: str, batch: bool = False) -> int:
        """Live leases of ``tenant``'s interactive (or batch) lane now (for tests and metrics)."""
        state = self._tenants.get(tenant)
        return 0 if state is None else len(self._live_leases(state, self._now(), batch))
