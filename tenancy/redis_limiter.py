"""The Redis-backed :class:`~tenancy.limiter.Limiter`: one limit shared by every gateway process.

Each operation is one Lua script over the tenant's hash-tagged keys (see ``tenancy.keyspace``),
so check-and-reserve is atomic across processes, and time is Redis's own ``TIME``, so gateways
with skewed clocks still agree. The scripts mirror ``tenancy.bucket`` line for line; the tests
run the same cases against both.

Redis unreachable (refused, timed out): ``admit`` answers by the configured
:class:`~tenancy.limiter.FailurePolicy`; never a silent per-process fallback. The client
reconnects on the next call, and ``EVALSHA`` reloads a script a restarted Redis has forgotten,
so service resumes by itself when Redis returns.

Admissions, settlements and budget reads go through one pipelined connection of their own
(``tenancy.script_batcher``), which Redis serves in the order they were written. A settlement (lease
release, token refund, budget charge, ledger: one script) is queued on it by
:meth:`settle_nowait`, written at the end of that turn of the event loop (after what the caller
sends meanwhile: its request's answer), and its request does not wait for the reply. So, on one
limiter (one gateway process): **whatever is admitted, or read, after ``settle_nowait`` returned
sees that settlement** (an admission or ``budgets`` by the connection's order; ``usage``,
``ledger`` and ``usage_sums``, which read through redis-py, by first waiting for the settlements
in flight). Another gateway's admission can come before it by about one round trip; the
request's hold stands until then, so a budget is never overshot (a hold may refuse a request
that the settlement would have let in, within that window).

A settlement that fails while Redis is away is not lost: it waits in a bounded in-process queue
and is retried with backoff by a background task, and at once after the next call that reaches
Redis. A persistent Redis keeps the leases across its restart, so without the retry a tenant
would stay locked out until the leases' TTL. Each settlement is idempotent on its request id (a
marker kept ``settle_keep_s``), so a retry of an attempt that did run (its answer lost) changes
nothing; an entry older than ``settle_keep_s`` is dropped, and logged (its usage is then lost).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis

from tenancy.billing import NO_CHARGE, Budget, BudgetRefusal, BudgetState, Charge, window_code
from tenancy.bucket import CONCURRENCY_RETRY_S, Limits, Reason, Step
from tenancy.config import Plan
from tenancy.errors import LimiterUnavailableError
from tenancy.keyspace import (
    UNAVAILABLE_ERRORS,
    budget_key,
    held_key,
    leases_key,
    ledger_hours_key,
    ledger_prefix,
    open_async,
    requests_key,
    settled_key,
    tokens_key,
    usage_key,
)
from tenancy.ledger import (
    DEFAULT_RETENTION_S,
    LedgerQuery,
    LedgerRow,
    Sums,
    field_prefix,
    read_redis_ledger,
    read_redis_sums,
)
from tenancy.limiter import (
    DEFAULT_LEASE_TTL_S,
    Decision,
    FailurePolicy,
    Lease,
    decision_from_step,
    lane_limits,
    new_lease_id,
    soft_threshold,
    untracked_decision,
)
from tenancy.script_batcher import Call, ScriptBatcher
from tenancy.scripts import ADMIT_SCRIPT, BUDGETS_SCRIPT, RENEW_SCRIPT, SETTLE_SCRIPT
from tenancy.usage import TenantUsage, read_redis_usage

logger = logging.getLogger("batchgate.tenancy")
_T = TypeVar("_T")

# Upper bound on one limiter call, retries included: a request never waits longer on Redis.
CALL_DEADLINE_S = 1.5
# Settlements kept for a retry while Redis is away; past this the oldest is dropped (its lease
# then ends by its TTL). 10,000 is minutes of a busy gateway's traffic, a few MiB.
MAX_PENDING_SETTLES = 10_000
# Backoff between retries of the kept settlements: the first retry soon, then doubling, capped
# so that a returning Redis is noticed within about a second.
SETTLE_RETRY_FIRST_S = 0.05
SETTLE_RETRY_MAX_S = 1.0
# How long a settlement kept in an outage is retried, and how long its request id is remembered
# in Redis so that a repeated settlement is a no-op.
SETTLE_KEEP_S = 3600.0


@dataclass(frozen=True)
class _PendingSettle:
    """A settlement that failed while Redis was away; ``drop_at`` is monotonic seconds."""

    lease: Lease
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
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
        settle_keep_s: float = SETTLE_KEEP_S,
        retention_s: float = DEFAULT_RETENTION_S,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._client = client
        self.policy = FailurePolicy.parse(policy)
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._skew_s = 0.0  # Redis's clock minus ours, as last seen (names the ledger's hour)
        self._deadline_s = call_deadline_s
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._settle = client.register_script(SETTLE_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)
        self._budgets = client.register_script(BUDGETS_SCRIPT)
        self._batcher = ScriptBatcher(client, call_deadline_s)  # admit, settle, budgets: in order
        self.settle_keep_s = settle_keep_s
        self.retention_s = retention_s
        self.on_soft_limit: Callable[[str, Budget], None] = lambda tenant, budget: None
        self._outage = False
        self._contacted = False  # whether any call has reached (or failed to reach) Redis yet
        self._pending: deque[_PendingSettle] = deque()
        self._retrier: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[bool]] = set()  # sent, their replies not yet in

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

    async def _call(
        self, what: str, script: Any, keys: Sequence[str], args: Sequence[Any], *, batched: bool = False
    ) -> Any:
        """Run a script within the call deadline; LimiterUnavailableError if Redis is away.
        ``batched``: pipelined on the batcher's connection, in order (idempotent calls only; the
        batcher bounds the call and drops a connection that overran it)."""
        if batched:
            return await self._reply(what, self._batcher.call(script, keys, args))
        return await self._reply(what, self._direct(script, keys, args))

    async def _direct(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        async with asyncio.timeout(self._deadline_s):
            return await script(keys=list(keys), args=list(args))

    async def _reply(self, what: str, reply: Awaitable[_T]) -> _T:
        """``reply`` awaited; LimiterUnavailableError if Redis is away (noted for the policy)."""
        try:
            result = await reply
        except UNAVAILABLE_ERRORS as exc:
            self._went_down(what, exc)
            raise LimiterUnavailableError(f"Redis unavailable during {what}: {exc!r}") from exc
        self._came_back()
        return result

    async def admit(
        self, tenant: str, plan: Plan, tokens: int, request_id: str, charge: Charge = NO_CHARGE
    ) -> Decision:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        limits = lane_limits(plan, charge.batch)
        if limits is None:
            return untracked_decision(
                tenant, tokens, request_id, self.lease_ttl_s, time.time(), charge=charge
            )
        lease_id = new_lease_id()
        lane = charge.batch
        keys = [tokens_key(tenant, lane), requests_key(tenant, lane), leases_key(tenant, lane)]
        keys += [held_key(tenant), leases_key(tenant, not lane)]
        keys += [budget_key(tenant, b.name) for b in charge.budgets]
        args: list[Any] = [
            tokens,
            limits.tokens_per_minute,
            limits.requests_per_minute,
            limits.max_concurrent_requests,
            lease_id,
            repr(float(self.lease_ttl_s)),
            self._now_arg(),
            repr(CONCURRENCY_RETRY_S),
            len(charge.budgets),
        ]
        for budget, amount in zip(charge.budgets, charge.reserved, strict=True):
            args += [budget.limit, window_code(budget.window), amount]
        try:
            raw = await self._call("admit", self._admit, keys, args, batched=True)
        except LimiterUnavailableError:
            return self._unavailable(tenant, tokens, request_id, charge)
        step, now = _parse_step(raw)
        self._skew_s = now - time.time()
        refusal = None
        if step.reason is Reason.BUDGET:
            index, used, reserved, window = (int(float(_text(v))) for v in raw[6:10])
            budget = charge.budgets[index - 1]
            refusal = BudgetRefusal(budget, used, reserved, charge.reserved[index - 1], window)
        lease = None
        if step.admitted:
            lease = Lease(
                lease_id, tenant, request_id, tokens, self.lease_ttl_s, now + self.lease_ttl_s, limits, charge
            )
        return decision_from_step(step, limits, tokens, lease, refusal)

    def _unavailable(self, tenant: str, tokens: int, request_id: str, charge: Charge = NO_CHARGE) -> Decision:
        if self.policy is FailurePolicy.FAIL_OPEN:
            logger.debug("tenancy: admitting %s without limits (fail_open)", request_id)
            return untracked_decision(
                tenant, tokens, request_id, self.lease_ttl_s, time.time(), Reason.UNAVAILABLE, charge
            )
        return Decision(admitted=False, reason=Reason.UNAVAILABLE, retry_after_s=1.0, requested_tokens=tokens)

    async def settle(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> bool:
        """Release the lease, refund, charge budgets and the ledger; False if the lease had
        expired, if this request was already settled, or if Redis is away (the settlement is
        then kept and retried when Redis answers again). :meth:`settle_nowait`, waited for."""
        settled = self.settle_nowait(lease, prompt_tokens, completion_tokens, cached_tokens)
        return await asyncio.shield(settled)

    def settle_nowait(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> asyncio.Future[bool]:
        """Queue the settlement on the ordered connection, ahead of every admission and budget read
        made after this returns, and write it at the end of this turn of the event loop (module
        docstring). The future gives :meth:`settle`'s answer; it never raises for Redis away."""
        keys, args = self._settle_call(lease, prompt_tokens, completion_tokens, cached_tokens)
        usage = (prompt_tokens, completion_tokens, cached_tokens)
        sent: Call | None = None
        try:
            sent = self._batcher.submit(self._settle, keys, args, defer=True)  # after the answer
        except UNAVAILABLE_ERRORS as exc:  # the limiter is closed
            self._went_down("settle", exc)
        task = asyncio.get_running_loop().create_task(
            self._settled(lease, usage, keys, args, sent), name=f"settle-{lease.request_id}"
        )
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def _settled(
        self,
        lease: Lease,
        usage: tuple[int, int, int],
        keys: list[str],
        args: list[Any],
        sent: Call | None,
    ) -> bool:
        """The answer to a settlement sent (``sent``; None: it could not be), kept for the retry
        if Redis is away."""
        try:
            if sent is None:
                raise LimiterUnavailableError("the limiter is closed")
            raw = await self._reply("settle", self._batcher.wait(sent))
            return await self._settle_reply(lease, keys, args, raw)
        except LimiterUnavailableError as exc:
            logger.warning(
                "tenancy: could not settle %s (%s); retrying when Redis returns", lease.request_id, exc
            )
            self._keep(_PendingSettle(lease, *usage, time.monotonic() + self.settle_keep_s))
            return False

    async def _settle_now(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> bool:
        """One settlement, waited for; LimiterUnavailableError when Redis is away (the retry's)."""
        keys, args = self._settle_call(lease, prompt_tokens, completion_tokens, cached_tokens)
        raw = await self._call("settle", self._settle, keys, args, batched=True)
        return await self._settle_reply(lease, keys, args, raw)

    def _settle_call(
        self, lease: Lease, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> tuple[list[str], list[Any]]:
        """The settle script's keys and arguments, for the hour (and the hours either side) that
        Redis's clock is expected to be in."""
        limits: Limits | None = lease.limits
        tenant = lease.tenant
        charge = lease.charge
        cached = min(max(cached_tokens, 0), prompt_tokens)
        now = float(self._clock()) if self._clock else time.time() + self._skew_s
        keys = [
            tokens_key(tenant, charge.batch),
            leases_key(tenant, charge.batch),
            usage_key(tenant),
            held_key(tenant),
            settled_key(tenant, lease.request_id),
            ledger_hours_key(tenant),
            *_ledger_hours(tenant, int(now // 3600)),
        ]
        keys += [budget_key(tenant, b.name) for b in charge.budgets]
        unused = lease.reserved_tokens - (prompt_tokens + completion_tokens) if limits else 0
        args: list[Any] = [
            lease.lease_id if limits else "",
            unused,
            limits.tokens_per_minute if limits else 1,
            prompt_tokens,
            completion_tokens,
            self._now_arg(),
            cached,
            charge.cost(prompt_tokens, cached, completion_tokens),
            field_prefix(charge.model, charge.key_id, charge.batch),
            ledger_prefix(tenant),
            int(self.retention_s),
            max(1, int(self.settle_keep_s)),
            len(charge.budgets),
        ]
        amounts = charge.amounts(prompt_tokens, cached, completion_tokens)
        for budget, amount in zip(charge.budgets, amounts, strict=True):
            soft = soft_threshold(budget)
            args += [budget.limit, window_code(budget.window), amount, "" if soft is None else soft]
        return keys, args

    async def _settle_reply(self, lease: Lease, keys: list[str], args: list[Any], raw: Any) -> bool:
        """Whether the lease was live, from the settle script's reply (sent again with the hour
        Redis names when our clock was off by over an hour; at most twice more)."""
        for _ in range(2):
            if _text(raw[0]) != "hour":
                break
            keys[6:9] = _ledger_hours(lease.tenant, int(float(_text(raw[1]))))
            raw = await self._call("settle", self._settle, keys, args, batched=True)
        if _text(raw[0]) == "hour":
            raise LimiterUnavailableError(f"settling {lease.request_id}: Redis's hour keeps moving")
        live, _duplicate, *crossed = (_text(v) for v in raw)
        for index in crossed:
            self.on_soft_limit(lease.tenant, lease.charge.budgets[int(index) - 1])
        return live == "1"

    async def settled(self) -> None:
        """Return once the settlements sent so far have been answered (or kept for the retry):
        what a read through another connection waits for, to see them."""
        if self._settling:
            await asyncio.wait(set(self._settling))

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
                    "tenancy: gave up settling %s after %.0f s of Redis outage (usage not counted)",
                    pending.lease.request_id,
                    self.settle_keep_s,
                )
                continue
            try:
                await self._settle_now(
                    pending.lease, pending.prompt_tokens, pending.completion_tokens, pending.cached_tokens
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
            keys = (leases_key(lease.tenant, lease.charge.batch), held_key(lease.tenant))
            return bool(await self._call("renew", self._renew, keys, args))
        except LimiterUnavailableError as exc:
            logger.warning("tenancy: could not renew the lease of %s (%s)", lease.request_id, exc)
            return False

    async def release(self, lease: Lease) -> None:
        if not lease.tracked:
            return
        key = leases_key(lease.tenant, lease.charge.batch)
        try:
            dropped = asyncio.wait_for(self._client.zrem(key, lease.lease_id), self._deadline_s)
            await self._reply("release", dropped)
        except LimiterUnavailableError as exc:
            logger.warning("tenancy: could not release the lease of %s (%s)", lease.request_id, exc)

    async def usage(self) -> dict[str, TenantUsage]:
        """Every tenant's usage; raises LimiterUnavailableError when Redis is away."""
        await self.settled()
        try:
            async with asyncio.timeout(self._deadline_s * 4):
                return await read_redis_usage(self._client)
        except TimeoutError as exc:
            raise LimiterUnavailableError("Redis did not answer in time while reading usage") from exc

    async def budgets(self, tenant: str, budgets: tuple[Budget, ...]) -> list[BudgetState]:
        """Each budget's use and holds now (LimiterUnavailableError when Redis is away)."""
        if not budgets:
            return []
        keys = [budget_key(tenant, b.name) for b in budgets]
        keys += [held_key(tenant), leases_key(tenant), leases_key(tenant, batch=True)]
        args = [self._now_arg(), *(window_code(b.window) for b in budgets)]
        reply = await self._call("budgets", self._budgets, keys, args, batched=True)  # after settlements
        raw = [int(float(_text(v))) for v in reply]
        return [BudgetState(b, raw[1 + 3 * i], raw[2 + 3 * i], raw[3 + 3 * i]) for i, b in enumerate(budgets)]

    async def ledger(self, tenants: list[str], start_hour: int, end_hour: int) -> list[LedgerRow]:
        """The ledger's rows (LimiterUnavailableError when Redis is away)."""
        return await self._read_ledger(read_redis_ledger(self._client, tenants, start_hour, end_hour))

    async def usage_sums(self, tenants: list[str], query: LedgerQuery) -> Sums:
        """The ledger summed by Redis (LimiterUnavailableError when Redis is away)."""
        return await self._read_ledger(read_redis_sums(self._client, tenants, query))

    async def _read_ledger(self, read: Awaitable[_T]) -> _T:
        await self.settled()
        try:
            async with asyncio.timeout(self._deadline_s * 4):
                return await read
        except UNAVAILABLE_ERRORS as exc:
            raise LimiterUnavailableError(f"Redis unavailable while reading the ledger: {exc!r}") from exc

    async def num_leases(self, tenant: str, batch: bool = False) -> int:
        """Leases of ``tenant``'s interactive (or batch) lane not yet expired by Redis's clock (for
        tests and metrics)."""
        await self.settled()
        now = float(self._clock()) if self._clock else await self._redis_time()
        return int(await self._client.zcount(leases_key(tenant, batch), f"({now!r}", "+inf"))

    async def _redis_time(self) -> float:
        seconds, micros = await self._client.time()
        return seconds + micros / 1_000_000

    async def aclose(self) -> None:
        """Close, once the settlements in flight are answered (or kept, then dropped: logged)."""
        await self.settled()
        if self._retrier is not None:
            self._retrier.cancel()
            await asyncio.gather(self._retrier, return_exceptions=True)
        if self._pending:
            logger.warning(
                "tenancy: closing with %d settlements not made (Redis away); their leases end by TTL",
                len(self._pending),
            )
            self._pending.clear()
        await self._batcher.aclose()
        await self._client.aclose()


def _ledger_hours(tenant: str, hour: int) -> list[str]:
    """The ledger hashes of ``hour`` and the hours either side (the settle script's KEYS[7..9])."""
    prefix = ledger_prefix(tenant)
    return [prefix + str(hour - 1), prefix + str(hour), prefix + str(hour + 1)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_step(raw: list[Any]) -> tuple[Step, float]:
    admitted, reason, retry, tok, req, now = (_text(v) for v in raw[:6])
    step = Step(admitted == "1", Reason(reason), float(retry), float(tok), float(req))
    return step, float(now)
