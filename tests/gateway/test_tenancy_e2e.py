"""Tenancy end to end: real uvicorn, the real engine (tiny model), a real redis-server, the openai SDK."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import LiveServer, tiny_async_engine

MSG = [{"role": "user", "content": "Hello there"}]
MODEL = "tiny"
TENANTS = """
[plans.paid]
priority = "paid"
tokens_per_minute = 100000
requests_per_minute = 600
max_concurrent_requests = 1
queue_deadline_seconds = 30

[plans.slow]
priority = "free"
tokens_per_minute = 100000
requests_per_minute = 60
max_concurrent_requests = 4
queue_deadline_seconds = 30

[plans.small]
priority = "free"
tokens_per_minute = 300
requests_per_minute = 600
max_concurrent_requests = 4
queue_deadline_seconds = 30

[tenants.acme]
plan = "paid"
keys = ["{acme}"]

[tenants.slowco]
plan = "slow"
keys = ["{slow}"]

[tenants.tiny]
plan = "small"
keys = ["{tiny}"]
"""


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    tenants = tmp_path_factory.mktemp("tenancy") / "tenants.toml"
    tenants.write_text(
        TENANTS.format(acme=hash_key("sk-acme"), slow=hash_key("sk-slow"), tiny=hash_key("sk-tiny"))
    )
    settings = Settings(
        tenants=str(tenants), redis_url=redis_server, keep_alive_s=1.0, embedding_model="none"
    )
    engine = tiny_async_engine(tiny_model_dir, MODEL)
    live = LiveServer(create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True))
    try:
        yield live
    finally:
        live.stop()
        engine.shutdown()


def client(server: Any, key: str, **kwargs: Any) -> openai.OpenAI:
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, **kwargs)


def test_unknown_key_is_a_401_in_openai_shape(server: Any) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(server, "sk-wrong").chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(info.value)


def test_success_carries_rate_limit_headers(server: Any) -> None:
    raw = client(server, "sk-acme").chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=3
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "600"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(raw.headers["x-ratelimit-remaining-requests"]) < 600
    for name in ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        assert name in raw.headers
    assert raw.parse().choices[0].message.content is not None


def test_prefix_cache_hits_stay_within_a_tenant(server: Any) -> None:
    messages = [
        {"role": "system", "content": "Answer as a lighthouse keeper would, briefly."},
        {"role": "user", "content": "A prompt long enough to fill two KV blocks of sixteen tokens " * 2},
    ]

    def cached(key: str) -> int:
        r = client(server, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens > 32
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("sk-acme") == 0
    assert cached("sk-acme") >= 32  # the same tenant's repeat
    assert cached("sk-slow") == 0  # another tenant's identical prompt: its own namespace


def test_rate_limit_is_a_429_and_the_sdk_retry_waits_retry_after(server: Any) -> None:
    # 60 requests/minute: a bucket of 60 that refills one request per second. The SDK (2 retries)
    # drains it; each attempt is recorded, so the wait between a 429 and its retry can be checked.
    attempts: list[tuple[float, httpx.Response]] = []
    hooks = {"response": [lambda response: attempts.append((time.monotonic(), response))]}
    sdk = client(server, "sk-slow", max_retries=2, http_client=httpx.Client(event_hooks=hooks))
    for _ in range(70):
        sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
        if any(r.status_code == 429 for _, r in attempts):
            break
    refused_at, refused = next((t, r) for t, r in attempts if r.status_code == 429)
    retried_at, retried = attempts[[r for _, r in attempts].index(refused) + 1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    wait_s = float(refused.headers["retry-after-ms"]) / 1000
    assert 0 < wait_s <= float(refused.headers["retry-after"]) <= 2
    assert retried_at - refused_at >= 0.9 * wait_s  # the SDK honoured Retry-After
    assert retried.status_code == 200
    with pytest.raises(openai.RateLimitError) as info:  # without retries the SDK raises at once
        for _ in range(70):
            client(server, "sk-slow").chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    assert info.value.status_code == 429


def test_a_request_larger_than_the_token_bucket_is_refused(server: Any) -> None:
    with pytest.raises(openai.RateLimitError) as info:
        client(server, "sk-tiny").chat.completions.create(model=MODEL, messages=MSG, max_tokens=400)
    assert "300" in str(info.value)


def test_a_concurrency_limit_of_one_refuses_the_second_stream(server: Any) -> None:
    sdk = client(server, "sk-acme")
    first = sdk.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
    got_first = next(iter(first))
    assert got_first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as info:
        sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, stream=True)
    assert info.value.code == "rate_limit_exceeded"
    first.close()
    # The lease is released when the first stream ends: the next request is admitted.
    deadline = time.monotonic() + 10
    while True:
        try:
            sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the first stream's lease was never released"
            time.sleep(0.05)


def test_overloaded_engine_answers_503_with_retry_after(tiny_model_dir: Path) -> None:
    # One slot and a 0.3 s queue deadline: a request queued behind a long one is refused with 503.
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            dtype="float32",
            max_num_seqs=1,
            max_model_len=1024,
            kv_cache_memory_bytes=16 << 20,
            default_queue_deadline_s=0.3,
        )
    )
    live = LiveServer(create_app(Settings(keep_alive_s=1.0, embedding_model="none"), engine=engine))
    try:
        long_request = threading.Thread(
            target=lambda: httpx.post(
                live.base_url + "/v1/chat/completions",
                timeout=60,
                json={"model": engine.model_name, "messages": MSG, "max_tokens": 900, "ignore_eos": True},
            )
        )
        long_request.start()
        deadline = time.monotonic() + 10
        while engine.stats().num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sdk = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            sdk.chat.completions.create(model=engine.model_name, messages=MSG, max_tokens=4)
        assert info.value.status_code == 503
        assert info.value.code == "server_overloaded"
        assert float(info.value.response.headers["retry-after"]) > 0
        long_request.join(timeout=60)
    finally:
        live.stop()
        engine.shutdown()
