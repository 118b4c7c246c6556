"""The one pipeline, in both modes: the same requests get the same answers in process and through a
gateway in front of a replica, and every way a request can end releases it exactly once.

Real HTTP (uvicorn), real tenancy (in memory for the parity cases, a real redis-server for the
release cases); the engine under the replica is the fake one (tests/gateway/fakes.py), so the
failures are injected where a real engine would fail.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from engine.types import GenerationFailedError
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tenancy.keyspace import leases_key, tokens_key, usage_key
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine

TOKEN = "internal-t0ken"
MODEL = "fake-model"
TPM = 600  # the release tests' bucket: refills 10 tokens/s, so a leak of ~100 shows for ~10 s
TENANTS = """
[plans.paid]
priority = "paid"
tokens_per_minute = {tpm}
requests_per_minute = 6000
max_concurrent_requests = 8
queue_deadline_seconds = 30

[plans.once]
priority = "free"
tokens_per_minute = 100000
requests_per_minute = 1
max_concurrent_requests = 8
queue_deadline_seconds = 30

[tenants.acme]
plan = "paid"
keys = ["{acme}"]

[tenants.once]
plan = "once"
keys = ["{once}"]

[tenants.umbrella]
plan = "paid"
keys = ["{umbrella}"]
"""
ACME = {"authorization": "Bearer sk-acme"}
UMBRELLA = {"authorization": "Bearer sk-umbrella"}
MODES = ("in-process", "proxy")


@dataclass
class Deployment:
    """One mode: the URL clients call, and the fake engine that answers in the end."""

    url: str
    engine: FakeEngine
    servers: list[LiveServer]

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def _tenants(tmp: Path, tpm: int) -> str:
    path = tmp / "tenants.toml"
    path.write_text(
        TENANTS.format(
            tpm=tpm, acme=hash_key("sk-acme"), once=hash_key("sk-once"), umbrella=hash_key("sk-umbrella")
        )
    )
    return str(path)


def deploy(mode: str, tmp: Path, redis_url: str | None = None, tpm: int = 100_000) -> Deployment:
    engine = FakeEngine(max_model_len=512)
    tenancy_settings = {"tenants": _tenants(tmp, tpm), "redis_url": redis_url}
    common = {"keep_alive_s": 0.2, "embedding_model": "none", "internal_token": TOKEN}
    if mode == "in-process":
        settings = Settings(**common, **tenancy_settings)
        app = create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True)
        server = LiveServer(app)
        return Deployment(server.base_url, engine, [server])
    replica = LiveServer(create_app(Settings(**common), engine=engine))
    settings = Settings(**common, **tenancy_settings, upstreams=(replica.base_url,), health_interval_s=0.2)
    gateway = LiveServer(create_app(settings, tenancy=build_tenancy(settings), owns_tenancy=True))
    _wait_for(lambda: httpx.get(gateway.base_url + "/ready").status_code == 200)
    return Deployment(gateway.base_url, engine, [replica, gateway])


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll a condition another thread makes true (bounded; the condition is the test's clock)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


# -- the same requests, the same answers ------------------------------------------------------


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Deployment]]:
    deployments = {mode: deploy(mode, tmp_path_factory.mktemp(mode)) for mode in MODES}
    try:
        yield deployments
    finally:
        for d in deployments.values():
            d.stop()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}


def resp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 5, **fields}


def message(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}


ANTHROPIC_ACME = {"x-api-key": "sk-acme", "anthropic-version": "2023-06-01"}
MSG = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "x" * 600}]  # over the fake engine's 512-token window


# (name, path, headers, body): each runs once per mode, in this order, and both answers must match.
CASES: list[tuple[str, str, dict[str, str], Any]] = [
    ("not json", "/v1/chat/completions", ACME, b"{nope"),
    ("unknown field", "/v1/chat/completions", ACME, chat(colour="red")),
    ("anonymous model probe", "/v1/chat/completions", {}, chat(model="secret-model")),
    ("anonymous, served model", "/v1/chat/completions", {}, chat()),
    ("bad key", "/v1/chat/completions", {"authorization": "Bearer sk-nope"}, chat()),
    ("unknown model", "/v1/chat/completions", ACME, chat(model="gpt-4o")),
    ("unknown model, completions", "/v1/completions", ACME, {"model": "gpt-4o", "prompt": "x"}),
    ("chat", "/v1/chat/completions", ACME, chat()),
    ("chat, stream", "/v1/chat/completions", ACME, chat(stream=True)),
    (
        "chat, stream with usage",
        "/v1/chat/completions",
        ACME,
        chat(stream=True, stream_options={"include_usage": True}),
    ),
    ("completion", "/v1/completions", ACME, {"model": MODEL, "prompt": "abc", "max_tokens": 4}),
    ("generate", "/v1/generate", ACME, {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0}),
    (
        "generate, stream",
        "/v1/generate",
        ACME,
        {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True},
    ),
    (
        "generate, a completions-only field",
        "/v1/generate",
        ACME,
        {"model": MODEL, "prompt": "x", "top_p": 0.5},
    ),
    ("context too long", "/v1/chat/completions", ACME, chat(max_tokens=600)),
    ("rate limited: first", "/v1/chat/completions", {"authorization": "Bearer sk-once"}, chat()),
    ("rate limited: second", "/v1/chat/completions", {"authorization": "Bearer sk-once"}, chat()),
    ("embeddings of a chat model", "/v1/embeddings", ACME, {"model": MODEL, "input": "x"}),
    ("responses", "/v1/responses", ACME, resp(instructions="Be brief.", metadata={"k": "v"})),
    ("responses, stream", "/v1/responses", ACME, resp(stream=True)),
    ("responses, ignored fields", "/v1/responses", ACME, resp(reasoning={"effort": "low"}, store=False)),
    ("responses, not stored", "/v1/responses", ACME, resp(store=False)),
    (
        "responses, image input",
        "/v1/responses",
        ACME,
        resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ),
    ("responses, unknown previous", "/v1/responses", ACME, resp(previous_response_id="resp_nope")),
    ("responses, anonymous", "/v1/responses", {}, resp()),
    ("responses, context too long", "/v1/responses", ACME, resp(max_output_tokens=600)),
    ("responses, input tokens", "/v1/responses/input_tokens", ACME, {"model": MODEL, "input": "hi"}),
    ("messages", "/v1/messages", ANTHROPIC_ACME, message(system="Brief.", metadata={"user_id": "u"})),
    ("messages, bearer key", "/v1/messages", ACME, message()),
    ("messages, stream", "/v1/messages", ANTHROPIC_ACME, message(stream=True)),
    (
        "messages, clamped",
        "/v1/messages",
        ANTHROPIC_ACME,
        message(max_tokens=32000, thinking={"type": "adaptive"}),
    ),
    ("messages, count", "/v1/messages/count_tokens", ANTHROPIC_ACME, {"model": MODEL, "messages": MSG}),
    ("messages, bad key", "/v1/messages", {"x-api-key": "sk-nope"}, message()),
    ("messages, anonymous", "/v1/messages", {}, message()),
    ("messages, unknown model", "/v1/messages", ANTHROPIC_ACME, message(model="claude-opus-5-5")),
    ("messages, no max_tokens", "/v1/messages", ANTHROPIC_ACME, {"model": MODEL, "messages": []}),
    ("messages, too long", "/v1/messages", ANTHROPIC_ACME, message(messages=LONG)),
]
TOKENIZER_CHECKS = {"context too long", "responses, context too long", "messages, too long"}
# Headers whose presence (not value: ids, times and remaining counts differ) must match.
COMPARED_HEADERS = (
    "content-type",
    "x-request-id",
    "retry-after",
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "cache-control",
    "x-accel-buffering",
    "x-batchgate-ignored",
    "x-batchgate-clamped-max-tokens",
)
_VARYING = {"id", "created", "created_at", "completed_at", "item_id"}


def _normalized(value: Any) -> Any:
    """A body with the fields that differ per response (ids, timestamps, waits) blanked."""
    if isinstance(value, str):
        return re.sub(r"[0-9]+\.[0-9]+s\b", "N.Ns", value)  # "try again in 59.958s"
    if isinstance(value, dict):
        return {k: ("*" if k in _VARYING else _normalized(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def _answer(r: httpx.Response) -> dict[str, Any]:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        frames = [line.removeprefix("data: ") for line in r.text.split("\n") if line.startswith("data: ")]
        body: Any = [f if f == "[DONE]" else _normalized(json.loads(f)) for f in frames]
    else:
        body = _normalized(r.json())
    headers = {h: h in r.headers for h in COMPARED_HEADERS}
    if "x-request-id" in r.headers and r.status_code == 200 and isinstance(body, dict) and "id" in body:
        headers["x-request-id is the response id"] = r.headers["x-request-id"] == r.json()["id"]
    return {"status": r.status_code, "body": body, "headers": headers}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_both_modes_answer_alike(both: dict[str, Deployment], case: int) -> None:
    name, path, headers, body = CASES[case]
    answers = {}
    for mode, d in both.items():
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(d.url + path, content=content, headers={"content-type": "application/json", **headers})
        answers[mode] = _answer(r)
    if name in TOKENIZER_CHECKS:
        # Checks that need the model's tokenizer run on the replica, after the gateway admitted
        # the request (it cannot count exactly): the same status and body, plus its headers.
        answers["in-process"].pop("headers"), answers["proxy"].pop("headers")
    assert answers["in-process"] == answers["proxy"]
    status = answers["proxy"]["status"]
    expected = {
        "not json": 400,
        "unknown field": 400,
        "anonymous model probe": 401,
        "anonymous, served model": 401,
        "bad key": 401,
        "unknown model": 404,
        "unknown model, completions": 404,
        "generate, a completions-only field": 400,
        "context too long": 400,
        "rate limited: second": 429,
        "embeddings of a chat model": 400,
        "responses, image input": 400,
        "responses, unknown previous": 400,  # OpenAI's previous_response_not_found
        "responses, anonymous": 401,
        "responses, context too long": 400,
        "messages, bad key": 401,
        "messages, anonymous": 401,
        "messages, unknown model": 404,
        "messages, no max_tokens": 400,
        "messages, too long": 400,
    }.get(name, 200)
    assert status == expected, answers["proxy"]
    if status == 404 and name.startswith("unknown model"):
        assert answers["proxy"]["body"]["error"]["code"] == "model_not_found"


def test_a_conversation_continues_in_both_modes_and_only_for_its_tenant(
    both: dict[str, Deployment],
) -> None:
    """previous_response_id: the engine (behind the gateway's replica too) gets the whole
    conversation; the stored response, its input items and continuations are the tenant's own."""
    for mode, d in both.items():
        with httpx.Client(base_url=d.url, headers=ACME, timeout=10) as client:
            first = client.post("/v1/responses", json=resp(input="first turn")).json()
            r = client.post("/v1/responses", json=resp(input="second turn", previous_response_id=first["id"]))
            assert r.status_code == 200, (mode, r.text)
            prompt = d.engine.tokenizer.decode(d.engine.submitted[-1].prompt_token_ids)
            assert prompt.index("first turn") < prompt.index("Hello") < prompt.index("second turn"), mode
            second = r.json()
            assert client.get(f"/v1/responses/{second['id']}").json() == second
            items = client.get(f"/v1/responses/{second['id']}/input_items").json()
            assert [i["content"][0]["text"] for i in items["data"]] == ["second turn"]
            for other in ({}, UMBRELLA):
                seen = httpx.get(f"{d.url}/v1/responses/{first['id']}", headers=other)
                assert seen.status_code == (401 if not other else 404), (mode, seen.text)
                replay = httpx.get(f"{d.url}/v1/responses/{first['id']}?stream=true", headers=other)
                assert replay.status_code == (401 if not other else 404), (mode, replay.text)
            replay = client.get(f"/v1/responses/{first['id']}?stream=true")  # not a background one
            assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream", mode
            stolen = client.post(
                "/v1/responses", json=resp(previous_response_id=first["id"]), headers=UMBRELLA
            )
            assert stolen.status_code == 400 and stolen.json()["error"]["param"] == "previous_response_id"
            assert stolen.json()["error"]["code"] == "previous_response_not_found"
            assert client.delete(f"/v1/responses/{first['id']}", headers=UMBRELLA).status_code == 404
            assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
            assert client.get(f"/v1/responses/{first['id']}").status_code == 404


# -- every way to end releases the request once -----------------------------------------------


def _usage(client: redis.Redis, tenant: str) -> dict[str, int]:
    raw = client.hgetall(usage_key(tenant))
    return {k.decode(): int(float(v)) for k, v in raw.items()}


def _live_leases(client: redis.Redis, tenant: str) -> int:
    seconds, micros = client.time()
    return int(client.zcount(leases_key(tenant), f"({seconds + micros / 1e6}", "+inf"))


def _bucket(client: redis.Redis, tenant: str) -> float:
    """The tenant's token bucket now, refilled by Redis's clock (a missing bucket is full)."""
    level, ts = client.hmget(tokens_key(tenant), "level", "ts")
    if level is None:
        return float(TPM)
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    return min(float(TPM), float(level) + (now - float(ts)) * TPM / 60)


@pytest.fixture(params=MODES)
def deployment(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str) -> Iterator[Deployment]:
    d = deploy(request.param, tmp_path, redis_url, tpm=TPM)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


def _settled(store: redis.Redis, num_requests: int) -> Callable[[], bool]:
    return lambda: (
        _live_leases(store, "acme") == 0 and _usage(store, "acme").get("requests", 0) == num_requests
    )


def test_a_client_that_leaves_before_the_first_token_is_refunded_once(
    deployment: Deployment, store: redis.Redis
) -> None:
    deployment.engine.gate = asyncio.Event()  # never set: the request waits for its first token
    with httpx.Client(base_url=deployment.url, headers=ACME, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=100)) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # kept: a dropped iterator closes the response
            assert next(chunks).startswith(b":")  # a keep-alive: the request is admitted and queued
            assert _live_leases(store, "acme") == 1
            assert _bucket(store, "acme") < TPM - 90  # prompt + 100 tokens reserved
            assert not deployment.engine.aborted
    _wait_for(lambda: bool(deployment.engine.aborted))
    _wait_for(_settled(store, 1))
    usage = _usage(store, "acme")
    assert usage.get("prompt_tokens", 0) == 0 and usage.get("completion_tokens", 0) == 0
    assert _bucket(store, "acme") == TPM  # everything refunded


def test_a_backend_failure_before_the_first_byte_is_refunded_once(
    deployment: Deployment, store: redis.Redis
) -> None:
    deployment.engine.error_before_first = GenerationFailedError("generation failed: boom")
    with httpx.Client(base_url=deployment.url, headers=ACME, timeout=10) as client:
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json=chat(stream=stream, max_tokens=100))
            assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    _wait_for(_settled(store, 2))
    usage = _usage(store, "acme")
    assert usage.get("prompt_tokens", 0) == 0 and usage.get("completion_tokens", 0) == 0
    assert _bucket(store, "acme") == TPM


def test_a_backend_failure_mid_stream_settles_what_was_used_once(
    deployment: Deployment, store: redis.Redis
) -> None:
    deployment.engine.fail_after = 2
    with httpx.Client(base_url=deployment.url, headers=ACME, timeout=10) as client:
        r = client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=100))
    assert r.status_code == 200
    events = [line for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "generation_failed" in events[-2]
    _wait_for(_settled(store, 1))
    usage = _usage(store, "acme")
    assert usage["completion_tokens"] == 2  # the two tokens streamed before the failure
    assert usage["prompt_tokens"] > 0
    # Charged exactly what was used, once: the bucket is down by that much (less what refilled).
    assert TPM - _bucket(store, "acme") <= usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_response_failing_mid_stream_ends_failed_and_settles_what_was_used_once(
    deployment: Deployment, store: redis.Redis
) -> None:
    deployment.engine.fail_after = 2
    with httpx.Client(base_url=deployment.url, headers=ACME, timeout=10) as client:
        r = client.post("/v1/responses", json=resp(stream=True, max_output_tokens=100))
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.failed"
        failed = events[-1]["response"]
        assert failed["error"]["code"] == "generation_failed" and failed["usage"]["output_tokens"] == 2
        assert client.get(f"/v1/responses/{failed['id']}").json()["status"] == "failed"
    _wait_for(_settled(store, 1))
    assert _usage(store, "acme")["completion_tokens"] == 2


def test_a_cancelled_background_response_releases_its_hold_once(
    deployment: Deployment, store: redis.Redis
) -> None:
    deployment.engine.gate = asyncio.Event()  # never set: the run waits for its first token
    with httpx.Client(base_url=deployment.url, headers=ACME, timeout=10) as client:
        queued = client.post("/v1/responses", json=resp(background=True, max_output_tokens=100)).json()
        assert queued["status"] == "queued" and queued["background"] is True, queued
        _wait_for(lambda: _live_leases(store, "acme") == 1)  # admitted, running without its client
        assert client.post(f"/v1/responses/{queued['id']}/cancel", headers=UMBRELLA).status_code == 404
        r = client.post(f"/v1/responses/{queued['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert client.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
    _wait_for(lambda: bool(deployment.engine.aborted))
    _wait_for(_settled(store, 1))
    assert _bucket(store, "acme") == TPM  # nothing was generated: everything refunded


def _tokens_served(url: str) -> float:
    """The tokens a server has taken in and put out (batchgate_tokens_total, every label)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return sum(s.value for f in families for s in f.samples if s.name == "batchgate_tokens_total")


def test_ten_turns_alternate_two_gateways_over_one_redis_with_a_replica_gone(
    tmp_path: Path, redis_url: str, tiny_model_dir: Path
) -> None:
    """Any gateway continues any conversation (the state is in Redis): with a real replica process
    SIGKILLed and then a gateway stopped mid-conversation, no turn loses its history (each turn's
    prompt is longer than the last) and none reads "not found"."""
    from tests.chaos.conftest import INTERNAL_TOKEN, start_replica, wait_ready

    replicas = [start_replica(f"replica{i}", tmp_path, tiny_model_dir) for i in range(2)]
    settings = Settings(
        keep_alive_s=0.2,
        embedding_model="none",
        internal_token=INTERNAL_TOKEN,
        tenants=_tenants(tmp_path, 100_000),
        redis_url=redis_url,
        upstreams=tuple(r.url for r in replicas),
        health_interval_s=0.2,
    )
    gateways = [
        LiveServer(create_app(settings, tenancy=build_tenancy(settings), owns_tenancy=True)) for _ in "ab"
    ]
    try:
        wait_ready(replicas)
        for g in gateways:
            _wait_for(lambda g=g: httpx.get(g.base_url + "/ready").status_code == 200)
        model = httpx.get(gateways[0].base_url + "/v1/models", headers=ACME).json()["data"][0]["id"]
        previous: dict[str, str] = {}
        statuses, prompts = [], []
        for turn in range(10):
            if turn == 4:  # mid-conversation, the replica serving it is SIGKILLed, gone without a word
                serving = max(replicas, key=lambda r: _tokens_served(r.url))
                assert _tokens_served(serving.url) > 0
                serving.kill()
            if turn == 7:
                gateways[0].stop()  # and then one gateway: the other carries on
            body = {"model": model, "input": f"turn {turn}", "max_output_tokens": 3, **previous}
            for _ in range(3):  # as the SDK would: a 5xx from the replica that left is retried
                url = gateways[turn % 2 if turn < 7 else 1].base_url + "/v1/responses"
                r = httpx.post(url, json=body, headers=ACME, timeout=30)
                statuses.append(r.status_code)
                if r.status_code < 500:
                    break
            assert r.status_code == 200, r.text
            previous = {"previous_response_id": r.json()["id"]}
            prompts.append(r.json()["usage"]["input_tokens"])
        assert 404 not in statuses and 400 not in statuses  # never "not found" (400 since issue 42)
        assert prompts == sorted(prompts) and len(set(prompts)) == 10  # the whole conversation, each turn
    finally:
        for server in gateways:  # stopping twice is harmless
            server.stop()
        for replica in replicas:
            replica.kill()


@pytest.mark.parametrize("fault", ["generation fails", "replica stops"])
def test_a_background_response_whose_replica_fails_reads_failed_and_releases_everything(
    tmp_path: Path, redis_url: str, store: redis.Redis, fault: str
) -> None:
    """Pool mode: the replica running a background response fails it mid-generation, or goes away
    while it runs; the response reads `failed` with a reason (never "not found"), and its lease and
    hold are settled once."""
    deployment = deploy("proxy", tmp_path, redis_url, tpm=TPM)
    replica = deployment.servers[0]
    try:
        if fault == "generation fails":
            deployment.engine.fail_after = 2
        else:
            deployment.engine.gate = asyncio.Event()  # never set: the run waits on the replica
        with httpx.Client(base_url=deployment.url, headers=ACME, timeout=10) as client:
            queued = client.post("/v1/responses", json=resp(background=True, max_output_tokens=100)).json()
            assert queued["status"] == "queued", queued
            if fault == "replica stops":
                _wait_for(lambda: deployment.engine.num_active == 1)
                replica.stop()

            def status() -> dict[str, Any]:
                r = client.get(f"/v1/responses/{queued['id']}")
                assert r.status_code == 200, r.text  # never a 404
                return dict(r.json())

            _wait_for(lambda: status()["status"] not in ("queued", "in_progress"), timeout_s=20)
            failed = status()
            assert failed["status"] == "failed" and failed["error"]["message"], failed
            assert failed["error"]["code"], failed
        _wait_for(_settled(store, 1))  # the gateway's lease released, the hold settled once
        if fault == "generation fails":  # (a replica that went away took its engine with it)
            assert deployment.engine.num_active == 0
    finally:
        deployment.stop()


def test_websocket_turns_go_through_the_pipeline_in_both_modes(both: dict[str, Deployment]) -> None:
    """A Responses WebSocket (gateway/responses/websocket.py) in process and in front of a replica
    (pool mode: each turn routed and relayed as an HTTP turn): a `store: false` turn continued from
    the socket's cache sends the engine the whole conversation; another tenant's response id reads
    as one that never existed."""
    from websockets.sync.client import connect

    def turn(ws: Any, **fields: Any) -> dict[str, Any]:
        ws.send(json.dumps({"type": "response.create", **resp(**fields)}))
        while True:
            event = json.loads(ws.recv(timeout=10))
            if event["type"] in ("response.completed", "response.incomplete", "error"):
                return dict(event)

    for mode, d in both.items():
        url = d.url.replace("http://", "ws://") + "/v1/responses"
        with connect(url, additional_headers=ACME) as ws:
            first = turn(ws, input="first turn", store=False)["response"]
            second = turn(ws, input="second turn", previous_response_id=first["id"], store=False)
            assert second["type"] == "response.incomplete", (mode, second)  # max_output_tokens 5
            prompt = d.engine.tokenizer.decode(d.engine.submitted[-1].prompt_token_ids)
            assert prompt.index("first turn") < prompt.index("second turn"), mode
            stored = turn(ws, input="stored")["response"]
        with connect(url, additional_headers=UMBRELLA) as ws:
            stolen = turn(ws, input="x", previous_response_id=stored["id"])
            assert stolen["error"]["code"] == "previous_response_not_found", (mode, stolen)
