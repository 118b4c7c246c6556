"""The admission arithmetic, as pure functions shared by every limiter backend.

Algorithm: two *token buckets* (one counting LLM tokens, one counting requests) and a
*concurrency lease set*.

* A token bucket of capacity ``C = limit_per_minute`` refills continuously at ``C / 60`` per
  second and never holds more than ``C``. A new (or expired-from-storage) bucket is full.
  This is a token bucket, not a window: a tenant may burst its whole minute at once, then
  proceeds at the sustained rate.
* A lease set holds one lease per request in flight, each with an expiry; expired leases are
  dropped before counting, so a crashed holder frees its slot after the lease TTL.

An admission reserves ``tokens`` from the token bucket, 1 from the request bucket and 1 lease,
all or nothing. The Redis backend runs the same steps in Lua (``tenancy.redis_limiter``); the
tests run one table of cases against both, so keep the two in step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# A concurrency refusal has no bucket to read a wait from: a slot frees when some request
# ends, which the limiter cannot predict. One second is the hint we give.
CONCURRENCY_RETRY_S = 1.0
SECONDS_PER_MINUTE = 60.0


class Reason(enum.StrEnum):
    """Why a request was (or was not) admitted."""

    OK = "ok"  # admitted, every limit respected
    TOKENS = "tokens"  # token bucket too low now; retry after ``retry_after_s``
    REQUESTS = "requests"  # request bucket empty now
    CONCURRENCY = "concurrency"  # max_concurrent_requests leases already held
    TOO_LARGE = "too_large"  # reservation exceeds the token bucket's capacity: never admissible
    UNAVAILABLE = "unavailable"  # the limiter's store (Redis) could not be reached
    BUDGET = "budget"  # a hard budget cannot hold the request's worst case until it resets


@dataclass(frozen=True)
class BucketState:
    """A stored token bucket: its level at time ``updated_at`` (seconds, the store's clock)."""

    level: float
    updated_at: float


@dataclass(frozen=True)
class Limits:
    """The three limits an admission checks; every value >= 1."""

    tokens_per_minute: int
    requests_per_minute: int
    max_concurrent_requests: int

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_minute / SECONDS_PER_MINUTE

    @property
    def requests_per_second(self) -> float:
        return self.requests_per_minute / SECONDS_PER_MINUTE


@dataclass(frozen=True)
class Step:
    """The outcome of one admission step.

    ``token_level`` and ``request_level`` are the bucket levels at ``now`` after the step (the
    reservation already taken when admitted); they are what the store must write back.
    """

    admitted: bool
    reason: Reason
    retry_after_s: float
    token_level: float
    request_level: float


def refilled(state: BucketState | None, now: float, capacity: float, rate_per_s: float) -> float:
    """The level of a bucket at ``now``: the stored level plus the refill since, capped.

    A missing bucket is full. A clock that went backwards refills nothing (never drains).
    """
    if state is None:
        return capacity
    elapsed = max(0.0, now - state.updated_at)
    return min(capacity, state.level + elapsed * rate_per_s)


def wait_for(level: float, amount: float, rate_per_s: float) -> float:
    """Seconds until a bucket at ``level`` holds ``amount`` (0 if it already does)."""
    if level >= amount:
        return 0.0
    return (amount - level) / rate_per_s


def seconds_to_full(level: float, capacity: float, rate_per_s: float) -> float:
    """Seconds until a bucket at ``level`` is back at ``capacity`` (OpenAI's ``reset``)."""
    return max(0.0, (capacity - level) / rate_per_s)


def refund(level: float, amount: float, capacity: float) -> float:
    """The level after giving back ``amount`` (never above ``capacity``; a negative amount
    gives nothing back and takes nothing)."""
    return min(capacity, level + max(0.0, amount))


def admission_step(
    *,
    now: float,
    tokens: int,
    limits: Limits,
    token_bucket: BucketState | None,
    request_bucket: BucketState | None,
    num_leases: int,
) -> Step:
    """Decide one admission for ``tokens`` at ``now``; pure.

    ``num_leases`` counts the leases still live at ``now`` (expired ones already pruned).
    When several limits refuse, the reason is the one with the longest wait (ties: tokens,
    then requests, then concurrency) and ``retry_after_s`` is that wait, so a client that
    waits ``retry_after_s`` finds both buckets sufficient (barring other traffic).
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    token_level = refilled(token_bucket, now, limits.tokens_per_minute, limits.tokens_per_second)
    request_level = refilled(request_bucket, now, limits.requests_per_minute, limits.requests_per_second)

    if tokens > limits.tokens_per_minute:
        return Step(False, Reason.TOO_LARGE, 0.0, token_level, request_level)

    reason, retry_after = Reason.OK, 0.0
    checks = (
        (Reason.TOKENS, token_level < tokens, wait_for(token_level, tokens, limits.tokens_per_second)),
        (Reason.REQUESTS, request_level < 1, wait_for(request_level, 1, limits.requests_per_second)),
        (Reason.CONCURRENCY, num_leases >= limits.max_concurrent_requests, CONCURRENCY_RETRY_S),
    )
    for check_reason, refused, wait in checks:
        if refused and (reason is Reason.OK or wait > retry_after):
            reason, retry_after = check_reason, wait
    if reason is not Reason.OK:
        return Step(False, reason, retry_after, token_level, request_level)
    return Step(True, Reason.OK, 0.0, token_level - tokens, request_level - 1)


def remaining(level: float) -> int:
    """Whole units left in a bucket, for ``x-ratelimit-remaining-*``."""
    return max(0, math.floor(level + 1e-9))
