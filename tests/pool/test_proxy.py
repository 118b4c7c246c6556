"""Gateway-only mode in process: fake replicas (small Starlette apps) behind a real proxy server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.admission import OPEN_CALLER, Caller
from gateway.app import create_app
from gateway.cli import _flag_value, build_parser
from gateway.pool.replicas import ReplicaSet as Pool
from gateway.pool.routing import affinity_key
from gateway.settings import Settings, option_specs
from tests.gateway.conftest import LiveServer

TOKEN = "t0ken"
MODEL = "fake-model"


class FakeReplica:
    """/ready, /v1/models, /v1/internal/stats and a chat endpoint whose behaviour a test sets."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"  # ok | die_mid_stream | overloaded
        self.first_delay_s = 0.0  # before the first frame (the replica's own headers go out at once)
        self.ready = True
        self.calls: list[dict[str, str]] = []
        app = Starlette(
            routes=[
                Route("/ready", self._ready),
                Route("/v1/models", self._models),
                Route("/v1/internal/stats", self._stats),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )
        self.server = LiveServer(app)
        self.url = self.server.base_url

    async def _ready(self, request: Request) -> Response:
        return JSONResponse({"status": "ready"}, 200 if self.ready else 503)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1}]})

    async def _stats(self, request: Request) -> Response:
        if request.headers.get("x-batchgate-internal") != TOKEN:
            return JSONResponse({}, 401)
        return JSONResponse({"num_waiting_tokens": 0, "num_running_tokens": 0})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(dict(request.headers))
        return JSONResponse(
            {
                "id": f"cmpl-{self.name}",
                "object": "text_completion",
                "choices": [{"index": 0, "text": body["prompt"][::-1], "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            },
            headers={"x-request-id": f"cmpl-{self.name}"},
        )

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(dict(request.headers))
        if self.mode == "overloaded":
            return JSONResponse(
                {"error": {"message": "busy", "type": "server_error", "code": "server_overloaded"}}, 503
            )
        chunk = {"id": f"chatcmpl-{self.name}", "object": "chat.completion.chunk", "model": MODEL}
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": f"chatcmpl-{self.name}",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": self.name}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                }
            )
        mode = self.mode
        delay = self.first_delay_s

        async def events() -> AsyncIterator[bytes]:
            yield b": keep-alive\n\n"
            await asyncio.sleep(delay)
            for word in ("a", "b"):
                payload = chunk | {"choices": [{"index": 0, "delta": {"content": word}}]}
                yield b"data: " + json.dumps(payload).encode() + b"\n\n"
                await asyncio.sleep(0)
            if mode == "die_mid_stream":
                raise RuntimeError("replica died")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    reps = [FakeReplica("r0"), FakeReplica("r1")]
    try:
        yield reps
    finally:
        for r in reps:
            r.stop()


def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def proxy(replicas: list[FakeReplica]) -> Iterator[LiveServer]:
    settings = Settings(
        upstreams=tuple(r.url for r in replicas),
        internal_token=TOKEN,
        health_interval_s=0.05,
        keep_alive_s=5.0,
    )
    server = LiveServer(create_app(settings))
    try:
        wait_for(lambda: len(upstreams(server, healthy=True)) == 2)
        yield server
    finally:
        server.stop()


def test_slow_first_frame_gets_keep_alives_then_the_stream(replicas: list[FakeReplica]) -> None:
    for rep in replicas:
        rep.first_delay_s = 0.5
    settings = Settings(
        upstreams=tuple(r.url for r in replicas),
        internal_token=TOKEN,
        health_interval_s=0.05,
        keep_alive_s=0.1,
    )
    server = LiveServer(create_app(settings))
    try:
        wait_for(lambda: len(upstreams(server, healthy=True)) == 2)
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body(stream=True), timeout=10)
        assert r.status_code == 200
        assert r.text.startswith(": keep-alive\n\n")
        events = events_of(r)
        assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == ["a", "b"]
        assert events[-1] == "[DONE]"
    finally:
        server.stop()


def upstreams(server: LiveServer, *, healthy: bool | None = None) -> list[dict[str, Any]]:
    ups = httpx.get(
        server.base_url + "/v1/internal/upstreams", headers={"x-batchgate-internal": TOKEN}
    ).json()
    return [u for u in ups if healthy is None or u["healthy"] is healthy]


def body(stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": stream,
    }


def post(proxy: LiveServer, request: dict[str, Any]) -> httpx.Response:
    return httpx.post(proxy.base_url + "/v1/chat/completions", json=request, timeout=10)


def events_of(r: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]


def test_streams_through_with_internal_headers(proxy: LiveServer, replicas: list[FakeReplica]) -> None:
    r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body(stream=True), timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r)
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == ["a", "b"]
    assert events[-1] == "[DONE]"
    (headers,) = [c for rep in replicas for c in rep.calls]
    assert headers["x-batchgate-internal"] == TOKEN
    assert headers["x-batchgate-priority"] == "paid"
    assert headers["x-batchgate-plan"] == "open"
    # What the gateway reserved: the replica keeps within it, and keeps the stream's usage for it.
    assert headers["x-batchgate-max-tokens"] == "2"
    assert headers["x-batchgate-request-id"].startswith("chatcmpl-")
    unbounded = {k: v for k, v in body().items() if k != "max_tokens"}
    assert post(proxy, unbounded).status_code == 200
    assert [c for rep in replicas for c in rep.calls][-1]["x-batchgate-max-tokens"] == "1024"


def test_replica_dying_mid_stream_gives_an_error_event_then_done(
    proxy: LiveServer, replicas: list[FakeReplica]
) -> None:
    for rep in replicas:
        rep.mode = "die_mid_stream"
    r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body(stream=True), timeout=10)
    assert r.status_code == 200
    events = events_of(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]] == ["a", "b"]


def test_failure_before_the_first_byte_is_retried_on_another_replica(
    proxy: LiveServer, replicas: list[FakeReplica]
) -> None:
    replicas[0].mode = "overloaded"
    for _ in range(6):
        r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body(), timeout=10)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "r1"
    replicas[1].mode = "overloaded"
    r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body(), timeout=10)
    assert r.status_code == 503  # every replica refused: the last refusal goes back to the client


def test_unready_replica_gets_no_requests_until_ready_again(
    proxy: LiveServer, replicas: list[FakeReplica]
) -> None:
    replicas[0].ready = False
    wait_for(lambda: len(upstreams(proxy, healthy=True)) == 1)
    for _ in range(5):
        assert httpx.post(proxy.base_url + "/v1/chat/completions", json=body(), timeout=10).status_code == 200
    assert not replicas[0].calls and len(replicas[1].calls) == 5
    assert httpx.get(proxy.base_url + "/ready").status_code == 200
    replicas[1].ready = False
    wait_for(lambda: not upstreams(proxy, healthy=True))
    assert httpx.get(proxy.base_url + "/ready").status_code == 503
    r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body(), timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    replicas[0].ready = True
    wait_for(lambda: len(upstreams(proxy, healthy=True)) == 1)
    assert httpx.post(proxy.base_url + "/v1/chat/completions", json=body(), timeout=10).status_code == 200
    assert len(replicas[0].calls) == 1


def test_requests_sharing_a_system_prompt_go_to_one_replica(
    proxy: LiveServer, replicas: list[FakeReplica]
) -> None:
    """Prefix affinity: same tenant and first message -> the same replica (its prefix cache holds
    that prompt's blocks); different first messages spread over the replicas."""
    for i in range(8):
        request = body() | {
            "messages": [
                {"role": "system", "content": "You are the support bot of Acme."},
                {"role": "user", "content": f"question {i}"},
            ]
        }
        assert post(proxy, request).status_code == 200
    assert sorted(len(r.calls) for r in replicas) == [0, 8]
    for i in range(24):
        request = body() | {"messages": [{"role": "user", "content": f"a different start {i}"}]}
        assert post(proxy, request).status_code == 200
    assert min(len(r.calls) for r in replicas) > 0


def test_affinity_is_bounded_by_load() -> None:
    pool = Pool(("http://a:1", "http://b:2", "http://c:3"), None, 1.0)
    for u in pool.upstreams:
        u.healthy, u.models = True, ("m",)
    key = affinity_key(OPEN_CALLER, {"messages": [{"role": "system", "content": "shared"}]})
    preferred = pool.pick("m", set(), key, slack_tokens=100)
    assert preferred is not None
    assert all(pool.pick("m", set(), key, slack_tokens=100) is preferred for _ in range(20))
    preferred.reported_tokens = 100  # at the margin above the others: still preferred
    assert pool.pick("m", set(), key, slack_tokens=100) is preferred
    preferred.reported_tokens = 101  # beyond it: the next in the key's order, among the least loaded
    second = pool.pick("m", set(), key, slack_tokens=100)
    assert second is not None and second is not preferred
    assert pool.pick("m", {second.url}, key, slack_tokens=100) not in (preferred, second)  # failover
    assert pool.pick("m", set(), key, slack_tokens=0) is not preferred  # affinity off: least loaded
    asyncio.run(pool.aclose())


def test_affinity_key_is_the_tenant_and_the_start_of_the_prompt() -> None:
    acme, other = Caller(name="acme", plan="paid"), Caller(name="other", plan="paid")
    system = {"role": "system", "content": "Be brief."}
    chat = lambda user: {"messages": [system, {"role": "user", "content": user}]}  # noqa: E731
    assert affinity_key(acme, chat("a")) == affinity_key(acme, chat("b"))
    assert affinity_key(acme, chat("a")) != affinity_key(other, chat("a"))
    assert affinity_key(Caller(name="x"), chat("a")) == affinity_key(Caller(name="y"), chat("a"))  # open
    ids = list(range(1000))
    assert affinity_key(acme, {"prompt": ids}) == affinity_key(acme, {"prompt": [*ids, 5]})
    assert affinity_key(acme, {"prompt": [1, 2, 3]}) != affinity_key(acme, {"prompt": [1, 2, 4]})
    assert affinity_key(acme, {"prompt": ["first", "second"]}) == affinity_key(acme, {"prompt": "first"})


def test_internal_upstreams_endpoint_needs_the_token(proxy: LiveServer) -> None:
    assert httpx.get(proxy.base_url + "/v1/internal/upstreams").status_code == 401


def test_upstream_flag_repeats_and_env_takes_a_list() -> None:
    args = build_parser().parse_args(["serve", "--upstream", "http://a:1", "--upstream", "http://b:2/"])
    flags = {s.name: _flag_value(s, getattr(args, s.name)) for s in option_specs()}
    assert Settings.load(flags, {}).upstreams == ("http://a:1", "http://b:2")
    env = {"BATCHGATE_UPSTREAMS": "http://a:1, http://b:2", "BATCHGATE_INTERNAL_TOKEN": "x"}
    settings = Settings.load({}, env)
    assert settings.upstreams == ("http://a:1", "http://b:2") and settings.internal_token == "x"
    with pytest.raises(ValueError, match="BATCHGATE_UPSTREAMS"):
        Settings.load({}, {"BATCHGATE_UPSTREAMS": "a:1"})


def test_completions_pass_through_with_the_replica_headers(proxy: LiveServer) -> None:
    r = httpx.post(
        proxy.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "cba"
    assert r.headers["x-request-id"].startswith("cmpl-r")


def test_limits_are_enforced_at_the_gateway(replicas: list[FakeReplica], tmp_path: Any) -> None:
    import tenancy

    path = tmp_path / "tenants.toml"
    path.write_text(
        f"""
[plans.free]
priority = "free"
tokens_per_minute = 100000
requests_per_minute = 2
max_concurrent_requests = 4
queue_deadline_seconds = 3

[tenants.acme]
plan = "free"
keys = ["{tenancy.hash_key("sk-acme")}"]
"""
    )
    settings = Settings(
        upstreams=tuple(r.url for r in replicas),
        internal_token=TOKEN,
        health_interval_s=0.05,
        tenants=str(path),
    )
    server = LiveServer(
        create_app(settings, tenancy=tenancy.Tenancy.from_settings(str(path), None), owns_tenancy=True)
    )
    try:
        wait_for(lambda: len(upstreams(server, healthy=True)) == 2)
        url = server.base_url + "/v1/chat/completions"
        assert httpx.post(url, json=body(), timeout=10).status_code == 401
        auth = {"authorization": "Bearer sk-acme"}
        assert [httpx.post(url, json=body(), headers=auth, timeout=10).status_code for _ in range(3)] == [
            200,
            200,
            429,
        ]
        calls = [c for rep in replicas for c in rep.calls]
        assert len(calls) == 2  # the refused and the unauthenticated request never reached a replica
        for headers in calls:
            assert headers["x-batchgate-priority"] == "free"
            assert headers["x-batchgate-plan"] == "free"
            assert headers["x-batchgate-deadline"] == "3.0"
            assert headers["x-batchgate-fairness"] == "acme"
            assert "authorization" not in headers  # the tenant's key stays at the gateway
        metrics = httpx.get(server.base_url + "/metrics").text
        assert 'batchgate_refusals_total{reason="rate_limit"} 1.0' in metrics
        assert 'batchgate_tokens_total{direction="out",plan="free"} 4.0' in metrics
    finally:
        server.stop()


def test_a_batch_line_reaches_the_replica_in_the_batch_class(
    proxy: LiveServer, replicas: list[FakeReplica]
) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body()}
    upload = httpx.post(
        proxy.base_url + "/v1/files",
        files={"file": ("in.jsonl", json.dumps(line).encode())},
        data={"purpose": "batch"},
    ).json()
    batch = httpx.post(
        proxy.base_url + "/v1/batches",
        json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    url = f"{proxy.base_url}/v1/batches/{batch['id']}"
    wait_for(lambda: httpx.get(url).json()["status"] == "completed")
    (headers,) = [c for rep in replicas for c in rep.calls]
    assert headers["x-batchgate-priority"] == "batch"
    assert "x-batchgate-deadline" not in headers  # a batch line waits for capacity, however long


def test_a_replica_takes_the_class_the_gateway_sends() -> None:
    from engine.types import Priority
    from gateway import admission

    for name, priority in (("paid", Priority.PAID), ("free", Priority.FREE), ("batch", Priority.BATCH)):
        headers = {"x-batchgate-internal": TOKEN, "x-batchgate-priority": name}
        caller = admission.internal_caller(TOKEN, headers, None)
        assert caller is not None and caller.priority is priority
    unknown = admission.internal_caller(
        TOKEN, {"x-batchgate-internal": TOKEN, "x-batchgate-priority": "vip"}, None
    )
    assert unknown is not None and unknown.priority is Priority.PAID
