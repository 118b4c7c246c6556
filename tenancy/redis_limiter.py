"""The Redis-backed :class:`~tenancy.limiter.Limiter`: one limit shared by every gateway process.

Each operation is one Lua script over the tenant's hash-tagged keys (see ``tenancy.keyspace``),
so check-and-reserve is atomic across processes, and time is Redis's own ``TIME``, so gateways
with skewed clocks still agree. The scripts mirror ``tenancy.bucket`` line for line; the tests
run the same cases against both.

Redis unreachable (refused, timed out): ``admit`` answers by the configured
:class:`~tenancy.limiter.FailurePolicy`; never a silent per-process fallback. The client
reconnects on the next call, and ``EVALSHA`` reloads a script a restarted Redis has forgotten,
so service resumes by itself when Redis returns.

A settlement (lease release and token refund) that fails while Redis is away is not lost: it
waits in a bounded in-process queue and is retried with backoff by a background task, and at
once after the next call that reaches Redis. A persistent Redis keeps the leases across its
restart, so without the retry a tenant would stay locked out until the leases' TTL. An entry
older than the lease TTL is dropped: by then the TTL has released the lease (its usage count is
lost, and logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tenancy.bucket import CONCURRENCY_RETRY_S, Limits, Reason, Step
from tenancy.config import Plan
from tenancy.errors import LimiterUnavailableError
from tenancy.keyspace import (
    UNAVAILABLE_ERRORS,
    leases_key,
    open_async,
    requests_key,
    tokens_key,
    usage_key,
)
from tenancy.limiter import (
    DEFAULT_LEASE_TTL_S,
    Decision,
    FailurePolicy,
    Lease,
    decision_from_step,
    limits_of,
    new_lease_id,
    untracked_decision,
)
from tenancy.usage import TenantUsage, read_redis_usage

logger = logging.getLogger("batchgate.tenancy")

# Upper bound on one limiter call, retries included: a request never waits longer on Redis.
CALL_DEADLINE_S = 1.5
# Settlements kept for a retry while Redis is away; past this the oldest is dropped (its lease
# then ends by its TTL). 10,000 is minutes of a busy gateway's traffic, a few MiB.
MAX_PENDING_SETTLES = 10_000
# Backoff between retries of the kept settlements: the first retry soon, then doubling, capped
# so that a returning Redis is noticed within about a second.
SETTLE_RETRY_FIRST_S = 0.05
SETTLE_RETRY_MAX_S = 1.0

# Shared by every script. `now` comes from Redis TIME unless the caller passes a clock override
# (tests only; production passes ''). Numbers are written with %.17g so they round-trip exactly,
# and returned as strings because Redis truncates Lua numbers to integers.
_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local function clock(override)
  if override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
-- tenancy.bucket.refilled
local function refilled(key, now, cap, rate)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  local elapsed = now - tonumber(v[2])
  if elapsed < 0 then elapsed = 0 end
  return math.min(cap, tonumber(v[1]) + elapsed * rate)
end
-- tenancy.bucket.wait_for
local function wait_for(level, amount, rate)
  if level >= amount then return 0 end
  return (amount - level) / rate
end
-- A missing bucket reads as full, so Redis may drop it once it would be full again.
local function store(key, now, level, cap, rate)
  redis.call('HSET', key, 'level', fmt(level), 'ts', fmt(now))
  redis.call('PEXPIRE', key, math.ceil((cap - level) / rate * 1000) + 1000)
end
-- Keep the lease set as long as its latest lease.
local function keep_leases(key, now)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIRE', key, math.ceil((tonumber(last[2]) - now) * 1000) + 1000)
  end
end
"""

# KEYS: tokens, requests, leases
# ARGV: tokens, tokens_per_minute, requests_per_minute, max_concurrent, lease_id, ttl_s, now_override,
#       concurrency_retry_s
# -> {admitted '0'|'1', reason, retry_after_s, token_level, request_level, now}
ADMIT_SCRIPT = (
    _PRELUDE
    + """
local tokens = tonumber(ARGV[1])
local tok_cap, req_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_leases, lease_id, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local now = clock(ARGV[7])
local tok_rate, req_rate = tok_cap / 60, req_cap / 60

-- tenancy.bucket.admission_step
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(now))
local num_leases = redis.call('ZCARD', KEYS[3])
local tok = refilled(KEYS[1], now, tok_cap, tok_rate)
local req = refilled(KEYS[2], now, req_cap, req_rate)
if tokens > tok_cap then
  return {'0', 'too_large', '0', fmt(tok), fmt(req), fmt(now)}
end
local reason, retry = 'ok', 0
local checks = {
  {'tokens', tok < tokens, wait_for(tok, tokens, tok_rate)},
  {'requests', req < 1, wait_for(req, 1, req_rate)},
  {'concurrency', num_leases >= max_leases, tonumber(ARGV[8])},
}
for _, c in ipairs(checks) do
  if c[2] and (reason == 'ok' or c[3] > retry) then
    reason, retry = c[1], c[3]
  end
end
if reason ~= 'ok' then
  return {'0', reason, fmt(retry), fmt(tok), fmt(req), fmt(now)}
end
tok, req = tok - tokens, req - 1
store(KEYS[1], now, tok, tok_cap, tok_rate)
store(KEYS[2], now, req, req_cap, req_rate)
redis.call('ZADD', KEYS[3], fmt(now + ttl), lease_id)
keep_leases(KEYS[3], now)
return {'1', 'ok', '0', fmt(tok), fmt(req), fmt(now)}
"""
)

# KEYS: tokens, leases, usage
# ARGV: lease_id, unused_tokens (reserved - used; may be < 0), tokens_per_minute,
#       prompt_tokens, completion_tokens, now_override, retry ('1' for a kept settlement retried)
# -> 1 if the lease was live (and the refund made), else 0
# A retry counts usage only if its lease is still there: an attempt that timed out may have run.
SETTLE_SCRIPT = (
    _PRELUDE
    + """
local now = clock(ARGV[6])
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
local live = 0
if score and tonumber(score) > now then live = 1 end
redis.call('ZREM', KEYS[2], ARGV[1])
local unused = tonumber(ARGV[2])
if live == 1 and unused > 0 then
  local cap = tonumber(ARGV[3])
  local rate = cap / 60
  -- tenancy.bucket.refund
  local level = math.min(cap, refilled(KEYS[1], now, cap, rate) + unused)
  store(KEYS[1], now, level, cap, rate)
end
if ARGV[7] ~= '1' or score or ARGV[1] == '' then
  redis.call('HINCRBY', KEYS[3], 'prompt_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[3], 'completion_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[3], 'requests', 1)
end
return live
"""
)

# KEYS: leases. ARGV: lease_id, ttl_s, now_override -> 1 if renewed, 0 if the lease is gone
RENEW_SCRIPT = (
    _PRELUDE
    + """
local now = clock(ARGV[3])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], fmt(now + tonumber(ARGV[2])), ARGV[1])
keep_leases(KEYS[1], now)
return 1
"""
)


@dataclass(frozen=True)
class _PendingSettle:
    """A settlement that failed while Redis was away; ``drop_at`` is monotonic seconds."""

    lease: Lease
    prompt_tokens: int
    completion_tokens: int
    drop_at: float


class RedisLimiter:
    """A :class:`~tenancy.limiter.Limiter` whose state lives in Redis.

    ``clock`` overrides Redis ``TIME`` (tests only, so time-dependent cases need no sleeps);
    leave it None in production. ``policy`` decides what ``admit`` answers when Redis cannot
    be reached within ``call_deadline_s``. Settlements that fail in an outage are retried (see
    the module docstring); ``aclose`` drops those still pending.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        policy: FailurePolicy | str = FailurePolicy.FAIL_CLOSED,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] | None = None,
        call_deadline_s: float = CALL_DEADLINE_S,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._client = client
        self.policy = FailurePolicy.parse(policy)
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._deadline_s = call_deadline_s
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._settle = client.register_script(SETTLE_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)
        self._outage = False
        self._contacted = False  # whether any call has reached (or failed to reach) Redis yet
        self._pending: deque[_PendingSettle] = deque()
        self._retrier: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisLimiter:
        """A limiter on a new client for ``url`` with tenancy's short socket timeouts."""
        return cls(open_async(url), **kwargs)

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    @property
    def reachable(self) -> bool | None:
        """Whether the last call (or :meth:`ping`) reached Redis; None before the first one."""
        return not self._outage if self._contacted else None

    @property
    def num_pending_settles(self) -> int:
        """Settlements kept for a retry because Redis was away when they were made."""
        return len(self._pending)

    async def ping(self) -> bool:
        """Whether Redis answers PING within a second; updates :attr:`reachable` (and, when it
        answers, retries the kept settlements)."""
        try:
            async with asyncio.timeout(min(self._deadline_s, 1.0)):
                await self._client.ping()
        except UNAVAILABLE_ERRORS as exc:
            self._went_down("ping", exc)
            return False
        self._came_back()
        return True

    def _went_down(self, what: str, exc: BaseException) -> None:
        self._contacted = True
        if not self._outage:
            # Once per outage, not per request: the policy's effect is stated here.
            self._outage = True
            effect = (
                "ADMITTING WITHOUT LIMITS (fail_open)"
                if self.policy is FailurePolicy.FAIL_OPEN
                else "refusing requests with 503 (fail_closed)"
            )
            logger.warning(
                "tenancy: Redis unavailable during %s (%r); %s until it returns", what, exc, effect
            )

    def _came_back(self) -> None:
        self._contacted = True
        if self._outage:
            self._outage = False
            logger.warning("tenancy: Redis reachable again; limits enforced")
        if self._pending:
            self._start_retrier()

    async def _call(self, what: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a script within the call deadline; LimiterUnavailableError if Redis is away."""
        try:
            async with asyncio.timeout(self._deadline_s):
                result = await script(keys=list(keys), args=list(args))
        except UNAVAILABLE_ERRORS as exc:
            self._went_down(what, exc)
            raise LimiterUnavailableError(f"Redis unavailable during {what}: {exc!r}") from exc
        self._came_back()
        return result

    async def admit(self, tenant: str, plan: Plan, tokens: int, request_id: str) -> Decision:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        limits = limits_of(plan)
        if limits is None:
            return untracked_decision(tenant, tokens, request_id, self.lease_ttl_s, time.time())
        lease_id = new_lease_id()
        keys = (tokens_key(tenant), requests_key(tenant), leases_key(tenant))
        args = (
            tokens,
            limits.tokens_per_minute,
            limits.requests_per_minute,
            limits.max_concurrent_requests,
            lease_id,
            repr(float(self.lease_ttl_s)),
            self._now_arg(),
            repr(CONCURRENCY_RETRY_S),
        )
        try:
            raw = await self._call("admit", self._admit, keys, args)
        except LimiterUnavailableError:
            return self._unavailable(tenant, tokens, request_id)
        step, now = _parse_step(raw)
        lease = None
        if step.admitted:
            lease = Lease(
                lease_id, tenant, request_id, tokens, self.lease_ttl_s, now + self.lease_ttl_s, limits
            )
        return decision_from_step(step, limits, tokens, lease)

    def _unavailable(self, tenant: str, tokens: int, request_id: str) -> Decision:
        if self.policy is FailurePolicy.FAIL_OPEN:
            logger.debug("tenancy: admitting %s without limits (fail_open)", request_id)
            return untracked_decision(
                tenant, tokens, request_id, self.lease_ttl_s, time.time(), Reason.UNAVAILABLE
            )
        return Decision(admitted=False, reason=Reason.UNAVAILABLE, retry_after_s=1.0, requested_tokens=tokens)

    async def settle(self, lease: Lease, prompt_tokens: int, completion_tokens: int) -> bool:
        """Release the lease and refund; False if the lease had expired, or if Redis is away (the
        settlement is then kept and retried when Redis answers again)."""
        try:
            return await self._settle_now(lease, prompt_tokens, completion_tokens)
        except LimiterUnavailableError as exc:
            logger.warning(
                "tenancy: could not settle %s (%s); retrying when Redis returns", lease.request_id, exc
            )
            self._keep(
                _PendingSettle(lease, prompt_tokens, completion_tokens, time.monotonic() + lease.ttl_s)
            )
            return False

    async def _settle_now(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, *, retry: bool = False
    ) -> bool:
        limits: Limits | None = lease.limits
        keys = (tokens_key(lease.tenant), leases_key(lease.tenant), usage_key(lease.tenant))
        unused = lease.reserved_tokens - (prompt_tokens + completion_tokens) if limits else 0
        args = (
            lease.lease_id if limits else "",
            unused,
            limits.tokens_per_minute if limits else 1,
            prompt_tokens,
            completion_tokens,
            self._now_arg(),
            "1" if retry else "",
        )
        return bool(await self._call("settle", self._settle, keys, args))

    def _keep(self, pending: _PendingSettle) -> None:
        if len(self._pending) >= MAX_PENDING_SETTLES:
            dropped = self._pending.popleft()
            logger.warning(
                "tenancy: %d settlements wait for Redis; dropped the oldest (%s), its lease ends by its TTL",
                MAX_PENDING_SETTLES,
                dropped.lease.request_id,
            )
        self._pending.append(pending)
        self._start_retrier()

    def _start_retrier(self) -> None:
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.get_running_loop().create_task(self._retry_pending(), name="settle-retry")

    async def _retry_pending(self) -> None:
        """Settle the kept entries in order, backing off while Redis is still away."""
        delay = SETTLE_RETRY_FIRST_S
        while self._pending:
            pending = self._pending[0]
            if time.monotonic() >= pending.drop_at:
                self._pending.popleft()
                logger.warning(
                    "tenancy: gave up settling %s: its lease TTL has released it (usage not counted)",
                    pending.lease.request_id,
                )
                continue
            try:
                await self._settle_now(
                    pending.lease, pending.prompt_tokens, pending.completion_tokens, retry=True
                )
            except LimiterUnavailableError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, SETTLE_RETRY_MAX_S)
                continue
            # Settled (or found already gone): done with it, whichever call got there first.
            if self._pending and self._pending[0] is pending:
                self._pending.popleft()
            delay = SETTLE_RETRY_FIRST_S

    async def renew(self, lease: Lease) -> bool:
        if not lease.tracked:
            return True
        args = (lease.lease_id, repr(float(lease.ttl_s)), self._now_arg())
        try:
            return bool(await self._call("renew", self._renew, (leases_key(lease.tenant),), args))
        except LimiterUnavailableError as exc:
            logger.warning("tenancy: could not renew the lease of %s (%s)", lease.request_id, exc)
            return False

    async def usage(self) -> dict[str, TenantUsage]:
        """Every tenant's usage; raises LimiterUnavailableError when Redis is away."""
        try:
            async with asyncio.timeout(self._deadline_s * 4):
                return await read_redis_usage(self._client)
        except TimeoutError as exc:
            raise LimiterUnavailableError("Redis did not answer in time while reading usage") from exc

    async def num_leases(self, tenant: str) -> int:
        """Leases of ``tenant`` not yet expired by Redis's clock (for tests and metrics)."""
        now = float(self._clock()) if self._clock else await self._redis_time()
        return int(await self._client.zcount(leases_key(tenant), f"({now!r}", "+inf"))

    async def _redis_time(self) -> float:
        seconds, micros = await self._client.time()
        return seconds + micros / 1_000_000

    async def aclose(self) -> None:
        if self._retrier is not None:
            self._retrier.cancel()
            await asyncio.gather(self._retrier, return_exceptions=True)
        if self._pending:
            logger.warning(
                "tenancy: closing with %d settlements not made (Redis away); their leases end by TTL",
                len(self._pending),
            )
            self._pending.clear()
        await self._client.aclose()


def _parse_step(raw: list[Any]) -> tuple[Step, float]:
    admitted, reason, retry, tok, req, now = (v.decode() if isinstance(v, bytes) else str(v) for v in raw)
    step = Step(admitted == "1", Reason(reason), float(retry), float(tok), float(req))
    return step, float(now)
