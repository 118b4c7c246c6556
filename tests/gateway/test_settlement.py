"""Settlement on the request path (issue 24): a real uvicorn gateway (the fake engine), a real
redis-server and the openai SDK. The answer does not wait for its settlement; whatever the same
gateway admits or reads after the client has its answer sees it; a drain waits for the
settlements in flight, so none is lost (docs/OPERATIONS.md, "Settlement and what a client sees")."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from engine.types import GenerationRequest
from gateway.app import create_app
from gateway.settings import Settings
from tenancy import hash_key
from tenancy.billing import Price
from tenancy.config import load_config
from tenancy.keys import KeyStore
from tenancy.redis_limiter import RedisLimiter
from tenancy.service import Tenancy
from tests.conftest_redis import RedisProcess
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine

KEY = "sk-acme"
PRICE = Price(input=1_000_000, cached_input=1_000_000, output=4_000_000)  # the file's, in micro-dollars
MAX_TOKENS = 400
TENANTS = """
[prices."fake-model"]
input = 1.0
output = 4.0

[plans.paid]
priority = "paid"
tokens_per_minute = 1000000
requests_per_minute = 100000
max_concurrent_requests = 100
queue_deadline_seconds = 30

[tenants.acme]
plan = "paid"
keys = ["{key}"]
{budget}
"""


class Gateway:
    """One gateway over `redis_url`, its limiter's call deadline `deadline_s`."""

    def __init__(self, tmp_path: Path, redis_url: str, budget: str = "", deadline_s: float = 1.5) -> None:
        tenants = tmp_path / "tenants.toml"
        tenants.write_text(TENANTS.format(key=hash_key(KEY), budget=budget))
        config = load_config(str(tenants))
        self.limiter = RedisLimiter.from_url(redis_url, call_deadline_s=deadline_s)
        tenancy = Tenancy(config, self.limiter, keys=KeyStore(config, self.limiter.client))
        self.closing = threading.Event()  # the server's shutdown has come to the tenancy
        close = tenancy.aclose

        async def aclose() -> None:
            self.closing.set()
            await close()

        tenancy.aclose = aclose  # type: ignore[method-assign]
        self.engine = FakeEngine(max_model_len=4096)
        self.loops: list[asyncio.AbstractEventLoop] = []

        def reply(request: GenerationRequest, index: int) -> str:
            self.loops.append(asyncio.get_running_loop())  # the server's, to set the gate from here
            return "Hello there!"

        self.engine.reply = reply
        settings = Settings(
            tenants=str(tenants), redis_url=redis_url, keep_alive_s=5.0, embedding_model="none"
        )
        self.server = LiveServer(create_app(settings, engine=self.engine, tenancy=tenancy, owns_tenancy=True))
        self.sdk = openai.OpenAI(base_url=self.server.base_url + "/v1", api_key=KEY, max_retries=0)

    def chat(self, stream: bool) -> tuple[int, int]:
        """One request through the SDK, read as the SDK reads it (a stream to its [DONE]):
        (prompt, completion) tokens."""
        messages: Any = [{"role": "user", "content": "hi"}]
        if not stream:
            usage = self.sdk.chat.completions.create(
                model="fake-model", messages=messages, max_tokens=MAX_TOKENS
            ).usage
        else:
            chunks = self.sdk.chat.completions.create(
                model="fake-model",
                messages=messages,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [c for c in chunks if c.usage][-1].usage
        assert usage is not None
        return usage.prompt_tokens, usage.completion_tokens

    def stop(self) -> None:
        self.sdk.close()  # uvicorn's shutdown would wait for its idle connection
        self.server.stop()

    def budget(self) -> dict[str, Any]:
        body = httpx.get(
            self.server.base_url + "/v1/usage", headers={"authorization": f"Bearer {KEY}"}
        ).json()
        (state,) = body["budgets"]
        return dict(state)


@pytest.fixture
def gateway(tmp_path: Path, redis_url: str) -> Iterator[Gateway]:
    # Room for one worst case (the prompt + MAX_TOKENS) and a few answers, never for two worst cases.
    g = Gateway(tmp_path, redis_url, f'budget_tokens = {2 * MAX_TOKENS - 1}\nbudget_window = "monthly"')
    try:
        yield g
    finally:
        g.stop()


def test_a_sequential_client_is_never_held_back_by_its_own_last_answer(gateway: Gateway) -> None:
    """A budget with room for one request's worst case and a little: each request, whole or
    streamed, comes right after the client had the previous answer, on the same gateway. Its
    admission runs after that answer's settlement (the gateway's one ordered connection), so the
    previous hold never refuses it (with it still there, two worst cases would not fit), and a read
    right after each answer finds the spend charged and nothing held."""
    spent, served = 0, 0
    while True:
        try:
            prompt, completion = gateway.chat(stream=served % 2 == 1)
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"
            break
        served += 1
        spent += prompt + completion
        state = gateway.budget()
        assert (state["used"], state["reserved"]) == (spent, 0), served
    assert spent + prompt + MAX_TOKENS > state["limit"]  # refused only when truly out of room
    assert served >= 5 and 2 * (prompt + MAX_TOKENS) > state["limit"]


def test_the_answer_does_not_wait_for_its_settlement_and_the_drain_does(
    tmp_path: Path, redis_process: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis frozen after admission, its limiter's deadline 60 s: a whole answer and a stream's
    [DONE] still come at once (their settlements wait in Redis's socket, or for a connection). Then,
    a request settled while the gateway has no connection to the frozen Redis, and the gateway
    shut down: the shutdown waits for that settlement, which lands when Redis thaws. Every request
    is in the ledger once."""
    caplog.set_level(logging.WARNING, logger="batchgate.tenancy")
    g = Gateway(tmp_path, redis_process.url, deadline_s=60.0)
    observer = redis.Redis.from_url(redis_process.url)
    reported: list[tuple[int, int]] = []
    stopped = False
    try:
        with ThreadPoolExecutor(2) as pool:
            for n, stream in enumerate((False, True, False)):
                g.engine.gate = asyncio.Event()  # the next request waits before its first token
                answer = pool.submit(g.chat, stream)
                deadline = time.monotonic() + 10
                while len(g.engine.submitted) < n + 1:  # admitted and running
                    assert time.monotonic() < deadline and not answer.done(), "not admitted"
                    time.sleep(0.01)
                if n == 2:  # the gateway's connections dropped: its settlement needs a new one
                    observer.client_kill_filter(_type="normal", skipme=True)
                redis_process.pause()
                try:
                    g.loops[-1].call_soon_threadsafe(g.engine.gate.set)
                    reported.append(answer.result(timeout=10))  # while Redis is frozen
                    if n == 2:
                        stopping = pool.submit(g.stop)
                        stopped = True
                        assert g.closing.wait(10)  # the shutdown has come to the tenancy
                finally:
                    redis_process.resume()
            if stopped:
                stopping.result(timeout=30)
        usage = observer.hgetall("{tenant:acme}:usage")
        assert {k.decode(): int(v) for k, v in usage.items()} == {
            "requests": 3,
            "prompt_tokens": sum(p for p, _ in reported),
            "completion_tokens": sum(c for _, c in reported),
        }
        assert not [r for r in caplog.records if "settle" in r.getMessage()], caplog.text
    finally:
        if not stopped:
            g.stop()
        observer.close()
