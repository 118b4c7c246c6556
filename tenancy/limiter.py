"""Admission control: the ``Limiter`` interface, its typed results, and the in-memory backend.

``admit`` reserves ``tokens`` from the tenant's token bucket, one request from its request
bucket and one concurrency lease, all or nothing (the arithmetic is in ``tenancy.bucket``).
The caller then runs the request, calls ``renew`` every ``lease_ttl_s / 3`` while it runs, and
``settle`` once when it ends, which refunds the tokens reserved but not used and releases the
lease. ``tenancy.service.LeaseHolder`` does the renew/settle part for the gateway.
"""

from __future__ import annotations

import enum
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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
    in the store: settling it only counts usage, renewing it is a no-op.
    """

    lease_id: str
    tenant: str
    request_id: str
    reserved_tokens: int
    ttl_s: float
    expires_at: float
    limits: Limits | None = None

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
        if not self.admitted and self.retry_after_s > 0:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers

    def message(self) -> str:
        """A sentence for the error body of a refusal (empty when admitted)."""
        if self.admitted:
            return ""
        wait = f" Please try again in {format_duration(self.retry_after_s)}."
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


def new_lease_id() -> str:
    """A random lease id, unique across gateway processes."""
    return uuid.uuid4().hex


def untracked_decision(
    tenant: str, tokens: int, request_id: str, ttl_s: float, now: float, reason: Reason = Reason.OK
) -> Decision:
    """An admission that holds nothing in the store (open mode, or fail_open)."""
    lease = Lease(new_lease_id(), tenant, request_id, 0, ttl_s, now + ttl_s, limits=None)
    return Decision(admitted=True, reason=reason, lease=lease, requested_tokens=tokens)


def decision_from_step(step: Step, limits: Limits, tokens: int, lease: Lease | None) -> Decision:
    """Turn an admission step (and the lease taken, if admitted) into a :class:`Decision`."""
    return Decision(
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

    Contract: ``admit`` is atomic per tenant (no interleaving can over-admit); a refusal
    changes no state except pruning expired leases. ``settle`` is called once per admitted
    lease, refunds ``reserved - used`` tokens (capped at capacity) only while the lease is
    still live, releases it, and counts usage; it returns whether the lease was still live.
    ``renew`` pushes a live lease's expiry to ``now + ttl`` and returns False for a lease that
    is gone (settled or expired). ``settle``/``renew`` never raise for an unreachable store:
    they log and return False (the lease then expires by itself).
    """

    lease_ttl_s: float

    async def admit(self, tenant: str, plan: Plan, tokens: int, request_id: str) -> Decision: ...

    async def settle(self, lease: Lease, prompt_tokens: int, completion_tokens: int) -> bool: ...

    async def renew(self, lease: Lease) -> bool: ...

    async def usage(self) -> dict[str, TenantUsage]: ...

    async def aclose(self) -> None: ...


@dataclass
class _TenantState:
    tokens: BucketState | None = None
    requests: BucketState | None = None
    leases: dict[str, float] | None = None  # lease_id -> expiry


class MemoryLimiter:
    """The :class:`Limiter` for a single process: state in dicts, time from ``now``.

    Safe for one asyncio event loop (no await between check and reserve). ``now`` is
    injectable so tests move time by hand instead of sleeping.
    """

    def __init__(
        self, *, now: Callable[[], float] = time.monotonic, lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._now = now
        self.lease_ttl_s = lease_ttl_s
        self._tenants: dict[str, _TenantState] = {}
        self._usage = MemoryUsage()

    def _live_leases(self, state: _TenantState, now: float) -> dict[str, float]:
        leases = {lid: exp for lid, exp in (state.leases or {}).items() if exp > now}
        state.leases = leases
        return leases

    async def admit(self, tenant: str, plan: Plan, tokens: int, request_id: str) -> Decision:
        now = self._now()
        limits = limits_of(plan)
        if limits is None:
            return untracked_decision(tenant, tokens, request_id, self.lease_ttl_s, now)
        state = self._tenants.setdefault(tenant, _TenantState())
        leases = self._live_leases(state, now)
        step = admission_step(
            now=now,
            tokens=tokens,
            limits=limits,
            token_bucket=state.tokens,
            request_bucket=state.requests,
            num_leases=len(leases),
        )
        if not step.admitted:
            return decision_from_step(step, limits, tokens, None)
        state.tokens = BucketState(step.token_level, now)
        state.requests = BucketState(step.request_level, now)
        lease = Lease(
            new_lease_id(), tenant, request_id, tokens, self.lease_ttl_s, now + self.lease_ttl_s, limits
        )
        leases[lease.lease_id] = lease.expires_at
        return decision_from_step(step, limits, tokens, lease)

    async def settle(self, lease: Lease, prompt_tokens: int, completion_tokens: int) -> bool:
        self._usage.add(lease.tenant, prompt_tokens, completion_tokens)
        limits = lease.limits
        state = self._tenants.get(lease.tenant)
        if limits is None or state is None:
            return False
        now = self._now()
        live = self._live_leases(state, now).pop(lease.lease_id, None) is not None
        if live:
            level = refilled(state.tokens, now, limits.tokens_per_minute, limits.tokens_per_second)
            unused = lease.reserved_tokens - (prompt_tokens + completion_tokens)
            state.tokens = BucketState(refund(level, unused, limits.tokens_per_minute), now)
        return live

    async def renew(self, lease: Lease) -> bool:
        if not lease.tracked:
            return True
        now = self._now()
        state = self._tenants.get(lease.tenant)
        if state is None:
            return False
        leases = self._live_leases(state, now)
        if lease.lease_id not in leases:
            return False
        leases[lease.lease_id] = now + lease.ttl_s
        return True

    async def usage(self) -> dict[str, TenantUsage]:
        return self._usage.snapshot()

    async def aclose(self) -> None:
        return None

    def num_leases(self, tenant: str) -> int:
        """Live leases of ``tenant`` now (for tests and metrics)."""
        state = self._tenants.get(tenant)
        return 0 if state is None else len(self._live_leases(state, self._now()))
