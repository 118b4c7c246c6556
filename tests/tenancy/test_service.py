"""The Tenancy facade: open mode, authentication, admission, lease holding, run-time keys."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from tenancy.bucket import Reason
from tenancy.cli import keys_new, keys_revoke
from tenancy.config import parse_config
from tenancy.errors import AuthError, LimiterUnavailableError, TenancyConfigError, UnknownTenantError
from tenancy.keys import KeyStore, hash_key
from tenancy.limiter import MemoryLimiter
from tenancy.service import INVALID_KEY_MESSAGE, MISSING_KEY_MESSAGE, Tenancy
from tenancy.usage import TenantUsage
from tests.conftest_redis import RedisProcess
from tests.tenancy.conftest import FakeClock

ACME_KEY = "bg-acme-static"
FREE_KEY = "bg-free-static"
TENANTS = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 1200
requests_per_minute = 600
max_concurrent_requests = 1
queue_deadline_seconds = 10

[plans.free]
priority = "free"
tokens_per_minute = 600
requests_per_minute = 60
max_concurrent_requests = 4
queue_deadline_seconds = 2

[tenants.acme]
plan = "paid"
keys = ["{hash_key(ACME_KEY)}"]

[tenants.hobby]
plan = "free"
keys = ["{hash_key(FREE_KEY)}"]
"""


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return str(path)


class FakeTime:
    """A clock plus an asyncio ``sleep`` that advances it instead of waiting."""

    def __init__(self) -> None:
        self.clock = FakeClock()

    async def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await asyncio.sleep(0)


def memory_tenancy(time: FakeTime, lease_ttl_s: float = 60.0) -> Tenancy:
    config = parse_config(TENANTS)
    return Tenancy(config, MemoryLimiter(now=time.clock, lease_ttl_s=lease_ttl_s), sleep=time.sleep)


async def test_open_mode_needs_no_key_and_has_no_limits() -> None:
    tenancy = Tenancy.from_settings(None, None)
    assert tenancy.open_mode
    tenant = await tenancy.authenticate(None)
    assert tenant.name == "default" and tenant.plan.priority == "paid" and tenant.plan.unlimited
    assert (await tenancy.authenticate("Bearer whatever")).name == "default"
    decision = await tenancy.admit(tenant, 10**6, 10**6, "r1")
    assert decision.admitted and decision.headers() == {}
    assert decision.lease is not None
    async with tenancy.hold(decision.lease) as held:
        held.record(prompt_tokens=7, completion_tokens=3)
    assert await tenancy.usage() == {"default": TenantUsage(7, 3, 1)}
    assert await tenancy.ready()
    await tenancy.aclose()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, MISSING_KEY_MESSAGE),
        ("", MISSING_KEY_MESSAGE),
        ("Bearer", MISSING_KEY_MESSAGE),
        (f"Basic {ACME_KEY}", MISSING_KEY_MESSAGE),
        ("Bearer bg-wrong", INVALID_KEY_MESSAGE),
    ],
)
async def test_authentication_failures(tenants_file: str, header: str | None, message: str) -> None:
    tenancy = Tenancy.from_settings(tenants_file, None)
    with pytest.raises(AuthError) as info:
        await tenancy.authenticate(header)
    assert str(info.value) == message
    assert "bg-wrong" not in str(info.value)


async def test_authenticate_resolves_tenant_and_plan(tenants_file: str) -> None:
    tenancy = Tenancy.from_settings(tenants_file, None)
    assert not tenancy.open_mode
    acme = await tenancy.authenticate(f"Bearer {ACME_KEY}")
    hobby = await tenancy.authenticate(f"bearer   {FREE_KEY}  ")
    assert (acme.name, acme.plan.priority, acme.plan.queue_deadline_seconds) == ("acme", "paid", 10.0)
    assert (hobby.name, hobby.plan.priority) == ("hobby", "free")


def test_bad_settings_fail_early(tmp_path: Path, tenants_file: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TENANTS.replace('plan = "free"', 'plan = "gold"'))
    with pytest.raises(TenancyConfigError, match="tenants.hobby.plan: unknown plan 'gold'"):
        Tenancy.from_settings(str(bad), None)
    with pytest.raises(ValueError, match="redis_policy"):
        Tenancy.from_settings(tenants_file, None, "fail_sometimes")


async def test_admit_reserves_prompt_plus_max_tokens_and_hold_settles_usage() -> None:
    time = FakeTime()
    tenancy = memory_tenancy(time)
    acme = await tenancy.authenticate(f"Bearer {ACME_KEY}")
    decision = await tenancy.admit(acme, prompt_tokens=100, max_tokens=900, request_id="r1")
    assert decision.admitted and decision.remaining_tokens == 200 and decision.lease is not None
    headers = decision.headers()
    assert headers["x-ratelimit-remaining-tokens"] == "200" and "retry-after" not in headers
    refused = await tenancy.admit(acme, prompt_tokens=10, max_tokens=10, request_id="r2")
    assert refused.reason is Reason.CONCURRENCY  # concurrency 1 and the first is in flight
    assert refused.headers()["retry-after"] == "1"
    async with tenancy.hold(decision.lease) as held:
        held.record(prompt_tokens=100)
        held.record(completion_tokens=50)
    # 850 of the 1000 reserved came back: 200 + 850 = 1050.
    after = await tenancy.admit(acme, prompt_tokens=1000, max_tokens=50, request_id="r3")
    assert after.admitted and after.remaining_tokens == 0
    assert (await tenancy.usage())["acme"] == TenantUsage(100, 50, 1)


async def test_hold_renews_a_long_stream_and_settles_on_exit() -> None:
    time = FakeTime()
    tenancy = memory_tenancy(time, lease_ttl_s=3.0)
    limiter = tenancy.limiter
    assert isinstance(limiter, MemoryLimiter)
    acme = await tenancy.authenticate(f"Bearer {ACME_KEY}")
    decision = await tenancy.admit(acme, 10, 10, "stream")
    assert decision.lease is not None
    async with tenancy.hold(decision.lease):
        for _ in range(30):  # each yield lets the renewer sleep 1 s (ttl/3) of fake time
            await asyncio.sleep(0)
        assert time.clock() >= 1_000.0 + 3 * decision.lease.ttl_s  # well past the first expiry
        assert limiter.num_leases("acme") == 1
    assert limiter.num_leases("acme") == 0
    assert (await tenancy.usage())["acme"] == TenantUsage(0, 0, 1)  # nothing recorded: all refunded


async def test_cancelled_request_still_settles() -> None:
    time = FakeTime()
    tenancy = memory_tenancy(time)
    limiter = tenancy.limiter
    assert isinstance(limiter, MemoryLimiter)
    acme = await tenancy.authenticate(f"Bearer {ACME_KEY}")
    decision = await tenancy.admit(acme, 10, 10, "r1")
    assert decision.lease is not None
    started = asyncio.Event()

    async def handler() -> None:
        async with tenancy.hold(decision.lease) as held:  # type: ignore[arg-type]
            held.record(prompt_tokens=10, completion_tokens=2)
            started.set()
            await asyncio.Event().wait()  # the client disconnects while we stream

    task = asyncio.create_task(handler())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await tenancy.aclose()
    assert limiter.num_leases("acme") == 0
    assert (await tenancy.usage())["acme"] == TenantUsage(10, 2, 1)


async def test_keys_issued_and_revoked_at_run_time(redis_url: str, tenants_file: str) -> None:
    tenancy = Tenancy.from_settings(tenants_file, redis_url)
    try:
        out, err = io.StringIO(), io.StringIO()
        issued = keys_new(redis_url, "hobby", tenants_file=tenants_file, out=out, err=err)
        assert out.getvalue().strip() == issued.raw_key  # shown once, on stdout only
        assert issued.raw_key not in err.getvalue() and issued.key_hash in err.getvalue()
        assert (await tenancy.authenticate(f"Bearer {issued.raw_key}")).name == "hobby"
        assert (await tenancy.authenticate(f"Bearer {ACME_KEY}")).name == "acme"  # static still works

        revocation = keys_revoke(redis_url, issued.raw_key, err=io.StringIO())
        assert revocation.issued_to == "hobby"
        with pytest.raises(AuthError):
            await tenancy.authenticate(f"Bearer {issued.raw_key}")

        keys_revoke(redis_url, hash_key(ACME_KEY), err=io.StringIO())  # static keys too, by hash
        with pytest.raises(AuthError):
            await tenancy.authenticate(f"Bearer {ACME_KEY}")

        with pytest.raises(UnknownTenantError):
            keys_new(redis_url, "nosuch", tenants_file=tenants_file, out=io.StringIO(), err=io.StringIO())
        orphan = keys_new(redis_url, "nosuch", out=io.StringIO(), err=io.StringIO())  # no file to check
        with pytest.raises(AuthError):
            await tenancy.authenticate(f"Bearer {orphan.raw_key}")
    finally:
        await tenancy.aclose()


async def test_key_lookup_follows_the_redis_policy(redis_process: RedisProcess, tenants_file: str) -> None:
    config = parse_config(TENANTS)
    closed = Tenancy.from_settings(tenants_file, redis_process.url, "fail_closed")
    opened = KeyStore(config, closed.limiter.client, policy="fail_open")  # type: ignore[attr-defined]
    try:
        assert (await closed.authenticate(f"Bearer {ACME_KEY}")).name == "acme"
        assert await closed.ready()
        redis_process.stop()
        with pytest.raises(LimiterUnavailableError):
            await closed.authenticate(f"Bearer {ACME_KEY}")
        assert not await closed.ready()
        tenant = await opened.resolve(ACME_KEY)  # static keys only
        assert tenant is not None and tenant.name == "acme"
        redis_process.start()
        assert (await closed.authenticate(f"Bearer {ACME_KEY}")).name == "acme"
    finally:
        await closed.aclose()
