"""RedisLimiter against a real redis-server: Redis's clock, atomicity across coroutines and OS
processes, crashed holders, and outages (stopped and frozen Redis)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection

from tenancy.billing import Budget, Charge
from tenancy.bucket import Reason
from tenancy.keyspace import UNAVAILABLE_ERRORS, leases_key, open_async, requests_key, tokens_key, usage_key
from tenancy.limiter import FailurePolicy, Lease
from tenancy.redis_limiter import RedisLimiter
from tenancy.script_batcher import ScriptBatcher, pack_command
from tests.conftest_redis import RedisProcess
from tests.tenancy.conftest import make_plan

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.tenancy._redis_worker"


async def redis_time(client: aioredis.Redis) -> float:
    seconds, micros = await client.time()
    return seconds + micros / 1_000_000


async def test_admit_uses_redis_time_and_hash_tagged_keys(redis_url: str) -> None:
    limiter = RedisLimiter.from_url(redis_url, lease_ttl_s=30.0)
    client = limiter.client
    try:
        before = await redis_time(client)
        decision = await limiter.admit("acme", make_plan(), 100, "r1")
        after = await redis_time(client)
        assert decision.lease is not None
        assert before + 30.0 <= decision.lease.expires_at <= after + 30.0
        keys = set(await client.keys("*"))
        assert keys == {tokens_key("acme"), requests_key("acme"), leases_key("acme")}
        assert keys == {"{tenant:acme}:tokens", "{tenant:acme}:requests", "{tenant:acme}:leases"}
        score = await client.zscore(leases_key("acme"), decision.lease.lease_id)
        assert score == pytest.approx(decision.lease.expires_at)
        # Buckets are dropped by Redis once they would be full again (~10 s for 100 tokens).
        assert 9_000 < await client.pttl(tokens_key("acme")) <= 11_000
        assert await limiter.num_leases("acme") == 1
        await limiter.settle(decision.lease, 10, 20)
        assert await client.hgetall(usage_key("acme")) == {
            "prompt_tokens": "10",
            "completion_tokens": "20",
            "requests": "1",
        }
        assert await limiter.num_leases("acme") == 0
    finally:
        await limiter.aclose()


async def test_100_concurrent_admits_never_exceed_the_budget(redis_url: str) -> None:
    # 600 tokens/min at 60 tokens a request: a budget of exactly 10 (the next refill of 60
    # tokens takes 6 s, far longer than this burst).
    limiter = RedisLimiter.from_url(redis_url)
    try:
        plan = make_plan(tokens_per_minute=600, requests_per_minute=10_000, max_concurrent_requests=10_000)
        decisions = await asyncio.gather(*(limiter.admit("acme", plan, 60, f"r{i}") for i in range(100)))
    finally:
        await limiter.aclose()
    admitted = [d for d in decisions if d.admitted]
    assert len(admitted) == 10
    assert {d.reason for d in decisions if not d.admitted} == {Reason.TOKENS}
    assert len({d.lease.lease_id for d in admitted if d.lease}) == 10


async def test_two_processes_share_one_global_limit(redis_url: str) -> None:
    # 600 tokens/min, 100 per request: 6 admissions in all; a 7th needs a 10 s refill.
    args = ["admit", redis_url, "shared", "20", "100", "600"]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", WORKER, *args, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
        )
        for _ in range(2)
    ]
    outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout=30)
    assert [p.returncode for p in procs] == [0, 0]
    counts = [int(out.decode().strip()) for out, _ in outputs]
    assert sum(counts) == 6, counts


async def test_lease_of_a_killed_process_expires(redis_url: str) -> None:
    # The worker takes the only slot at (test) clock 1000 with a 1 s TTL, then is SIGKILLed
    # without settling. Time is the scripts' clock override, so no sleep is needed.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", WORKER, "hold", redis_url, "acme", "1.0", "1000.0",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line.decode().strip() == "held"
    finally:
        proc.kill()
        await proc.wait()

    now = 1000.0
    limiter = RedisLimiter.from_url(redis_url, clock=lambda: now)
    plan = make_plan(tokens_per_minute=1000, max_concurrent_requests=1)
    try:
        now = 1000.5
        assert (await limiter.admit("acme", plan, 10, "r1")).reason is Reason.CONCURRENCY
        now = 1001.001
        assert (await limiter.admit("acme", plan, 10, "r2")).admitted
    finally:
        await limiter.aclose()


async def test_stopped_redis_fail_closed_then_service_resumes(
    redis_process: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    closed = RedisLimiter(open_async(redis_process.url), policy=FailurePolicy.FAIL_CLOSED)
    opened = RedisLimiter(open_async(redis_process.url), policy="fail_open")
    plan = make_plan(max_concurrent_requests=1)
    try:
        first = await closed.admit("acme", plan, 10, "r1")
        assert first.admitted and first.lease is not None

        redis_process.stop()
        start = time.monotonic()
        refused = await closed.admit("acme", plan, 10, "r2")
        assert time.monotonic() - start < 2.0
        assert (refused.admitted, refused.reason) == (False, Reason.UNAVAILABLE)
        assert refused.headers() == {"retry-after": "1", "retry-after-ms": "1000"}
        with caplog.at_level(logging.WARNING, logger="batchgate.tenancy"):
            for _ in range(3):
                let_through = await opened.admit("acme", plan, 10, "r3")
                assert (let_through.admitted, let_through.reason) == (True, Reason.UNAVAILABLE)
        warned = [r for r in caplog.records if "ADMITTING WITHOUT LIMITS" in r.getMessage()]
        assert len(warned) == 1  # once per outage, not once per request
        assert let_through.lease is not None and not let_through.lease.tracked
        assert not await closed.settle(first.lease, 1, 1)  # logged, not raised
        assert not await closed.renew(first.lease)

        redis_process.start()  # same port, empty: scripts must be reloaded, sockets reopened
        resumed = await closed.admit("acme", plan, 10, "r4")
        assert resumed.admitted and resumed.reason is Reason.OK
        assert (await opened.admit("acme", plan, 10, "r5")).reason is Reason.CONCURRENCY  # enforced again
    finally:
        await closed.aclose()
        await opened.aclose()


async def test_frozen_redis_answers_within_the_deadline(redis_process: RedisProcess) -> None:
    # SIGSTOP: the kernel still accepts connections but Redis never replies: only timeouts help.
    limiter = RedisLimiter(open_async(redis_process.url), call_deadline_s=1.0)
    plan = make_plan()
    try:
        assert (await limiter.admit("acme", plan, 10, "r1")).admitted
        redis_process.pause()
        start = time.monotonic()
        refused = await limiter.admit("acme", plan, 10, "r2")
        elapsed = time.monotonic() - start
        assert refused.reason is Reason.UNAVAILABLE and elapsed < 2.0, elapsed
        # A settlement meets the same deadline: kept for the retry, which lands it once Redis thaws.
        redis_process.resume()
        third = await limiter.admit("acme", plan, 10, "r3")
        assert third.admitted and third.lease is not None
        redis_process.pause()
        start = time.monotonic()
        assert not await limiter.settle(third.lease, 4, 5)
        assert time.monotonic() - start < 2.0 and limiter.num_pending_settles == 1
        redis_process.resume()
        deadline = time.monotonic() + 5.0
        while limiter.num_pending_settles:
            assert time.monotonic() < deadline, "the settlement was not retried within 5 s"
            await asyncio.sleep(0.05)
        usage = (await limiter.usage())["acme"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.num_requests) == (4, 5, 1)
    finally:
        redis_process.resume()
        await limiter.aclose()


async def test_a_settle_failed_in_an_outage_is_retried_when_redis_returns(
    persistent_redis_process: RedisProcess,
) -> None:
    # Redis with persistence (as in production) keeps the lease across its restart; the lease TTL
    # is ten minutes, so only the retried settle can release it within the few seconds allowed.
    redis_process = persistent_redis_process
    limiter = RedisLimiter(open_async(redis_process.url), lease_ttl_s=600.0)
    plan = make_plan(tokens_per_minute=60, max_concurrent_requests=4)  # refills 1 token/s
    observer = aioredis.Redis.from_url(redis_process.url)
    try:
        decision = await limiter.admit("acme", plan, 50, "r1")
        assert decision.admitted and decision.lease is not None

        redis_process.stop()  # the request runs on and ends while Redis is down
        assert not await limiter.settle(decision.lease, 10, 5)
        redis_process.start()
        # Read at once, synchronously: the limiter's retry (on this loop) cannot run before it.
        with redis.Redis.from_url(redis_process.url) as sync_observer:
            assert sync_observer.zcard(leases_key("acme")) == 1  # the lease survived the restart

        # No further call from this test: the limiter's own retry must settle it.
        deadline = time.monotonic() + 5.0
        while await observer.zcard(leases_key("acme")) != 0:
            assert time.monotonic() < deadline, "the failed settle was not retried within 5 s"
            await asyncio.sleep(0.05)
        level = float(await observer.hget(tokens_key("acme"), "level") or 0)
        assert level >= 10 + 35  # the 35 unused tokens were refunded (refill alone: ~10 + seconds)
        assert int(await observer.hget(usage_key("acme"), "completion_tokens") or 0) == 5
        assert limiter.num_pending_settles == 0
        hour = int(time.time() // 3600)
        (row,) = await limiter.ledger(["acme"], hour - 1, hour + 2)  # the ledger has it, once
        assert (row.requests, row.input, row.output) == (1, 10, 5)
    finally:
        await observer.aclose()
        await limiter.aclose()


async def test_kept_settlements_are_bounded_and_dropped_after_settle_keep_s(
    redis_process: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tenancy.redis_limiter.MAX_PENDING_SETTLES", 3)
    limiter = RedisLimiter(open_async(redis_process.url), lease_ttl_s=0.5, settle_keep_s=0.5)
    plan = make_plan()
    try:
        leases = []
        for i in range(5):
            decision = await limiter.admit("acme", plan, 10, f"r{i}")
            assert decision.lease is not None
            leases.append(decision.lease)
        redis_process.stop()
        for lease in leases:
            assert not await limiter.settle(lease, 1, 1)
        assert limiter.num_pending_settles == 3  # the oldest two dropped
        assert limiter.reachable is False
        # Redis stays away past settle_keep_s: the entries are given up.
        deadline = time.monotonic() + 5.0
        while limiter.num_pending_settles:
            assert time.monotonic() < deadline, "kept settlements outlived settle_keep_s"
            await asyncio.sleep(0.05)
    finally:
        await limiter.aclose()


async def test_a_retried_settlement_that_already_ran_counts_usage_once(redis_url: str) -> None:
    # A settle that timed out may still have run in Redis; its retry must not count usage twice.
    limiter = RedisLimiter(open_async(redis_url))
    try:
        decision = await limiter.admit("acme", make_plan(), 50, "r1")
        assert decision.lease is not None
        assert await limiter.settle(decision.lease, 10, 5)
        assert not await limiter._settle_now(decision.lease, 10, 5)
        usage = (await limiter.usage())["acme"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.num_requests) == (10, 5, 1)
        hour = int(time.time() // 3600)
        (row,) = await limiter.ledger(["acme"], hour - 1, hour + 2)
        assert (row.requests, row.input, row.output) == (1, 10, 5)
    finally:
        await limiter.aclose()


async def admitted(limiter: RedisLimiter, n: int) -> list[Lease]:
    """The leases of `n` requests of tenant acme, admitted one by one."""
    leases = []
    for i in range(n):
        decision = await limiter.admit("acme", make_plan(), 10, f"r{i}")
        assert decision.lease is not None
        leases.append(decision.lease)
    return leases


def test_commands_are_packed_as_redis_py_packs_them() -> None:
    command = ("EVALSHA", "a" * 40, 2, "{tenant:é}:k", b"raw\r\n", 0, -7, 1.5, repr(0.1), "")
    assert pack_command(command) == b"".join(Connection().pack_commands([command]))
    with pytest.raises(TypeError):
        pack_command(("SET", "k", True))


async def test_concurrent_settlements_share_round_trips_and_each_gets_its_own_answer(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []  # commands per write, counted around the real flush
    flush = ScriptBatcher._flush

    def counted(self: ScriptBatcher) -> None:
        sizes.append(len(self._outbox))
        flush(self)

    monkeypatch.setattr(ScriptBatcher, "_flush", counted)
    limiter = RedisLimiter(open_async(redis_url))
    try:
        leases = await admitted(limiter, 40)
        assert await limiter.settle(leases[0], 2, 3)  # alone: so that Redis knows the script
        sizes.clear()
        firsts = [limiter.settle(lease, 2, 3) for lease in leases[1:]]
        repeated = [limiter.settle(lease, 2, 3) for lease in leases[:10]]  # already settled by then
        assert await asyncio.gather(*firsts, *repeated) == [True] * 39 + [False] * 10
        assert sum(sizes) == 49 and len(sizes) <= 3, sizes
        usage = (await limiter.usage())["acme"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.num_requests) == (80, 120, 40)
        assert await limiter.num_leases("acme") == 0
    finally:
        await limiter.aclose()


async def test_settlements_survive_a_script_flush_and_a_restarted_redis(
    persistent_redis_process: RedisProcess,
) -> None:
    limiter = RedisLimiter(open_async(persistent_redis_process.url), lease_ttl_s=600.0)
    try:
        leases = await admitted(limiter, 2)
        await limiter.client.script_flush()
        assert await limiter.settle(leases[0], 1, 2)  # NOSCRIPT: sent again as EVAL
        persistent_redis_process.restart()  # its lease kept (persistence), the connection dead
        assert await limiter.settle(leases[1], 1, 2)  # reconnected and sent again at once
        assert limiter.num_pending_settles == 0
        usage = (await limiter.usage())["acme"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.num_requests) == (2, 4, 2)
    finally:
        await limiter.aclose()


async def _settle_across_a_connection_closed_under_the_batcher(redis_url: str) -> None:
    limiter = RedisLimiter(open_async(redis_url), call_deadline_s=1.0)
    try:
        leases = await admitted(limiter, 2)
        assert await limiter.settle(leases[0], 1, 2)
        wire = limiter._batcher._wire
        assert wire is not None and wire.transport is not None
        wire.transport.close()  # as when Redis went away: connection_lost comes a turn later
        started = time.monotonic()
        assert await limiter.settle(leases[1], 1, 2)  # sent again at once on a new connection
        assert time.monotonic() - started < 0.5 and limiter.num_pending_settles == 0
    finally:
        await limiter.aclose()


async def test_a_connection_closed_under_the_batcher_is_replaced_at_once(redis_url: str) -> None:
    await _settle_across_a_connection_closed_under_the_batcher(redis_url)


def test_a_connection_closed_under_the_batcher_is_replaced_at_once_on_uvloop(redis_url: str) -> None:
    import uvloop  # the gateway's event loop under uvicorn, whose transports raise on a write once closed

    uvloop.run(_settle_across_a_connection_closed_under_the_batcher(redis_url))


def _hello_reply(command: list[bytes], protocol: int) -> tuple[bytes, int]:
    """What a real Redis (7.x) answers to ``HELLO [protover ...]`` on a connection speaking
    `protocol`, and the protocol the connection speaks after it: the server's properties as a map
    in RESP3 (``%``), as a flat array of names and values in RESP2, and ``-NOPROTO`` for a version
    it does not speak (the connection keeps its protocol)."""
    if len(command) > 1:
        try:
            protocol_asked = int(command[1])
        except ValueError:
            return b"-ERR Protocol version is not an integer or out of range\r\n", protocol
        if protocol_asked not in (2, 3):
            return b"-NOPROTO unsupported protocol version\r\n", protocol
        protocol = protocol_asked
    properties: list[tuple[bytes, bytes | int | list[bytes]]] = [
        (b"server", b"redis"), (b"version", b"7.2.4"), (b"proto", protocol), (b"id", 1),
        (b"mode", b"standalone"), (b"role", b"master"), (b"modules", []),
    ]

    def encode(value: bytes | int | list[bytes]) -> bytes:
        if isinstance(value, int):
            return b":%d\r\n" % value
        if isinstance(value, list):
            return b"*%d\r\n" % len(value) + b"".join(map(encode, value))
        return b"$%d\r\n%s\r\n" % (len(value), value)

    head = b"%%%d\r\n" % len(properties) if protocol == 3 else b"*%d\r\n" % (2 * len(properties))
    return head + b"".join(encode(name) + encode(value) for name, value in properties), protocol


# None: the client's default protocol (RESP2 before redis-py 8, RESP3 from 8 on, which sends
# HELLO 3 on connect); 2 and 3: asked for explicitly.
@pytest.mark.parametrize("protocol", [None, 2, 3])
async def test_an_error_reply_of_the_connection_kind_fails_the_call_and_keeps_the_settlement(
    protocol: int | None,
) -> None:
    """A Redis still loading its data after a restart answers `-LOADING` (redis-py parses it as
    a ConnectionError, not a ResponseError): the call raises it, so the limiter keeps the
    settlement for its retry instead of reading the error as a reply. The fake server answers
    the connection's handshake (HELLO) as Redis does, in the protocol the client asks for."""
    import hiredis

    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        speaking = 2  # a new connection speaks RESP2 until HELLO 3
        while data := await reader.read(65536):
            parser.feed(data)
            while (command := parser.gets()) is not False:
                name = command[0].upper()
                received.append(name)
                if name == b"HELLO":
                    reply, speaking = _hello_reply(command, speaking)
                elif name in (b"EVALSHA", b"EVAL"):
                    reply = b"-LOADING Redis is loading the dataset\r\n"
                else:  # SELECT, CLIENT SETINFO, ...
                    reply = b"+OK\r\n"
                writer.write(reply)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    options = {} if protocol is None else {"protocol": protocol}
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", **options)
    batcher = ScriptBatcher(client, deadline_s=2.0)
    try:
        with pytest.raises(redis.exceptions.BusyLoadingError):
            await batcher.call(client.register_script("return 1"), [], [])
        assert isinstance(redis.exceptions.BusyLoadingError(), UNAVAILABLE_ERRORS)
        if protocol == 3:  # the handshake that asked for RESP3 was answered, and in it
            assert b"HELLO" in received
    finally:
        await batcher.aclose()
        await client.aclose()
        server.close()


def _tokens_charge(budget: Budget, prompt: int, max_tokens: int) -> Charge:
    return Charge.worst_case((budget,), num_prompt_tokens=prompt, max_tokens=max_tokens, model="m")


async def test_what_is_admitted_or_read_after_a_settlement_was_sent_sees_it(redis_url: str) -> None:
    """A settlement is sent, not waited for; what the same limiter admits or reads after that runs
    after it (one ordered connection; the ledger and usage reads wait for it). A token budget
    with room for one request's worst case (60) and nine requests' real use (10 each): each
    admission right after the previous settlement was sent finds that hold released (with it
    still there, 60 + 60 would not fit), and each read finds the use charged and nothing held."""
    limiter = RedisLimiter.from_url(redis_url)
    budget = Budget("tokens", 60 + 9 * 10, "monthly")
    plan = make_plan(tokens_per_minute=100_000, requests_per_minute=100_000)
    try:
        for i in range(10):
            decision = await limiter.admit("acme", plan, 60, f"r{i}", _tokens_charge(budget, 10, 50))
            assert decision.admitted and decision.lease is not None, (i, decision.message())
            sent = limiter.settle_nowait(decision.lease, 10, 0)
            assert not sent.done()  # on its way: nobody waits for its reply
            (state,) = await limiter.budgets("acme", (budget,))
            assert (state.used, state.reserved) == (10 * (i + 1), 0)
        last = limiter.settle_nowait(decision.lease, 10, 0)  # sent again: a no-op (its request id)
        refused = await limiter.admit("acme", plan, 60, "r10", _tokens_charge(budget, 10, 50))
        assert refused.reason is Reason.BUDGET  # 100 used + 60 > 150: truly full, not held
        usage = (await limiter.usage())["acme"]
        assert (usage.num_requests, usage.prompt_tokens) == (10, 100)
        hour = int(time.time() // 3600)
        (row,) = await limiter.ledger(["acme"], hour - 1, hour + 2)
        assert (row.requests, row.input) == (10, 100)
        assert last.done() and not last.result()
    finally:
        await limiter.aclose()


async def test_the_order_holds_when_a_restarted_redis_has_forgotten_the_scripts(
    persistent_redis_process: RedisProcess,
) -> None:
    """After a restart Redis knows no script, and another gateway's admission loads the admit
    script first. This limiter's settlement, then its admission, still run in that order: the
    first call of each script on a new connection is an EVAL (a NOSCRIPT answer, sent again,
    would run the settlement after the admission, which would find the hold still there)."""
    url = persistent_redis_process.url
    limiter = RedisLimiter(open_async(url), lease_ttl_s=600.0)
    other = RedisLimiter(open_async(url))
    budget = Budget("tokens", 100, "monthly")
    plan = make_plan(tokens_per_minute=100_000)
    try:
        first = await limiter.admit("acme", plan, 60, "r1", _tokens_charge(budget, 10, 50))
        assert first.lease is not None
        persistent_redis_process.restart()  # the hold kept (append-only file), the scripts gone
        assert (await other.admit("globex", plan, 10, "g1")).admitted
        settled = limiter.settle_nowait(first.lease, 10, 0)
        second = await limiter.admit("acme", plan, 60, "r2", _tokens_charge(budget, 10, 50))
        assert second.admitted, second.message()  # 10 used + 60 fits; 60 held + 60 would not
        assert await settled
    finally:
        await other.aclose()
        await limiter.aclose()


async def test_an_admission_sent_again_takes_nothing_twice(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batcher sends a call again when its connection broke after Redis had answered others:
    an admission that did run (its reply lost) finds its lease and takes nothing more."""
    monkeypatch.setattr("tenancy.redis_limiter.new_lease_id", lambda: "lease-1")
    limiter = RedisLimiter.from_url(redis_url)
    budget = Budget("tokens", 1000, "monthly")
    plan = make_plan(tokens_per_minute=600, requests_per_minute=600, max_concurrent_requests=5)
    try:
        first = await limiter.admit("acme", plan, 100, "r1", _tokens_charge(budget, 10, 90))
        again = await limiter.admit("acme", plan, 100, "r1", _tokens_charge(budget, 10, 90))
        assert first.admitted and again.admitted
        assert first.remaining_tokens == again.remaining_tokens == 500
        assert first.remaining_requests == again.remaining_requests == 599
        assert await limiter.num_leases("acme") == 1
        (state,) = await limiter.budgets("acme", (budget,))
        assert state.reserved == 100
    finally:
        await limiter.aclose()
