"""The app over a fake engine: response shapes, streaming, n, logprobs, errors, tenancy seam."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    Priority,
    PromptTooLongError,
)
from tests.gateway.conftest import AppFactory, client_for
from tests.gateway.fakes import FakeDecision, FakeEngine, FakeTenancy
from tests.gateway.helpers import parse_sse, validate

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, **fields}


async def test_models_and_probes(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    validate(r.json(), "ModelList")
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    r = await client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert (await client.get("/health")).json() == {"status": "ok"}
    assert (await client.get("/ready")).json() == {"status": "ready", "model": MODEL, "models": [MODEL]}


async def test_probes_when_engine_stopped(make_app: AppFactory, fake_engine: FakeEngine) -> None:
    fake_engine.ready = False
    async with client_for(make_app()) as c:
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/ready")).status_code == 503
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert r.headers["retry-after"] == "5"


async def test_health_fails_when_the_engine_stalls_past_the_timeout(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    """A loop that makes no progress while work waits gets restarted (/health), and gateways stop
    routing to it meanwhile (/ready)."""
    async with client_for(make_app(engine_stall_timeout_s=30.0)) as c:
        fake_engine.stalled_s = 29.0
        assert (await c.get("/health")).json() == {"status": "ok"}
        assert (await c.get("/ready")).status_code == 200
        fake_engine.stalled_s = 31.0
        assert (await c.get("/ready")).status_code == 503
        r = await c.get("/health")
        assert r.status_code == 503
        assert r.json() == {
            "status": "error",
            "detail": "the engine made no progress for 31s while work was waiting (stall timeout 30s)",
        }
        fake_engine.ready = False
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["detail"] == "the engine was shut down"


async def test_chat_completion_shape_and_usage(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    body = r.json()
    validate(body, "ChatCompletion")
    assert body["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == body["id"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello 0!", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    (request,) = fake_engine.submitted
    num_prompt = len(request.prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 8,
        "total_tokens": num_prompt + 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert request.sampling.max_tokens == 256 - num_prompt  # default: the context left
    assert request.priority is Priority.PAID and request.fairness_key == ""


async def test_chat_n_length_stop(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/chat/completions", json=chat(n=2))).json()
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
        (0, "Hello 0!"),
        (1, "Hello 1!"),
    ]
    assert body["usage"]["completion_tokens"] == 16

    body = (await client.post("/v1/chat/completions", json=chat(max_tokens=3))).json()
    assert body["choices"][0]["message"]["content"] == "Hel"
    assert body["choices"][0]["finish_reason"] == "length"

    body = (await client.post("/v1/chat/completions", json=chat(stop=["lo"]))).json()
    assert body["choices"][0]["message"]["content"] == "Hel"
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_chat_logprobs(client: httpx.AsyncClient) -> None:
    body = (
        await client.post("/v1/chat/completions", json=chat(max_tokens=2, logprobs=True, top_logprobs=2))
    ).json()
    validate(body, "ChatCompletion")
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "H",
        "logprob": -0.5,
        "bytes": [72],
        "top_logprobs": [
            {"token": "H", "logprob": -0.5, "bytes": [72]},
            {"token": "I", "logprob": -1.5, "bytes": [73]},
        ],
    }
    assert [c["token"] for c in content] == ["H", "e"]


async def test_chat_stream_shape(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    events, comments = parse_sse(r.text)
    assert comments == []
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        validate(c, "ChatCompletionChunk")
        assert "usage" in c
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] == r.headers["x-request-id"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello 0!"
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


async def test_chat_stream_without_include_usage_has_no_usage_key(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat(stream=True))
    events, _ = parse_sse(r.text)
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_chat_stream_n2_interleaves_choices(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat(stream=True, n=2))
    events, _ = parse_sse(r.text)
    texts = {0: "", 1: ""}
    roles = set()
    order = []
    for c in events[:-1]:
        (choice,) = c["choices"]
        order.append(choice["index"])
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if "role" in choice["delta"]:
            roles.add(choice["index"])
    assert texts == {0: "Hello 0!", 1: "Hello 1!"}
    assert roles == {0, 1}
    assert order[:4] == [0, 0, 1, 1]  # role then first token of each, interleaved


async def test_completions(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["ab", "c"], "n": 2, "echo": True}
    )
    body = r.json()
    validate(body, "Completion")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    texts = [(c["index"], c["text"]) for c in body["choices"]]
    assert texts == [(0, "abHello 0!"), (1, "abHello 1!"), (2, "cHello 0!"), (3, "cHello 1!")]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 32
    assert [r.prompt_token_ids for r in fake_engine.submitted] == [[97, 98], [99]]
    assert fake_engine.submitted[0].sampling.max_tokens == 16

    body = (await client.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3], [4]]})).json()
    assert [c["text"] for c in body["choices"]] == ["Hello 0!", "Hello 0!"]
    assert [r.prompt_token_ids for r in fake_engine.submitted[2:]] == [[1, 2, 3], [4]]


async def test_completions_logprobs_and_stream(client: httpx.AsyncClient) -> None:
    body = (
        await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1, "max_tokens": 2}
        )
    ).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["H", "e"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"H": -0.5}, {"e": -0.5}],
        "text_offset": [0, 1],
    }
    r = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
    )
    events, _ = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    for c in events[:-1]:
        validate(c, "Completion")
    assert "".join(c["choices"][0]["text"] for c in events[:-2]) == "Hello 0!"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8


async def test_mid_stream_failure_is_an_error_event_then_done(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    fake_engine.fail_after = 3
    async with client_for(make_app()) as c:
        r = await c.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200
        events, _ = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        error = events[-2]
        validate(error, "Error")
        assert error["error"]["code"] == "generation_failed" and error["error"]["type"] == "server_error"
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == "Hel"

        r = await c.post("/v1/chat/completions", json=chat())  # not streamed: a 500 that is not our bug
        assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"


@pytest.mark.parametrize("stream", [False, True])
async def test_refusal_before_first_byte_is_a_status(
    make_app: AppFactory, fake_engine: FakeEngine, stream: bool
) -> None:
    fake_engine.error_before_first = EngineOverloadedError("queue deadline passed", retry_after_s=2.5)
    async with client_for(make_app()) as c:
        r = await c.post("/v1/chat/completions", json=chat(stream=stream))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"] == {
        "message": "queue deadline passed",
        "type": "server_error",
        "param": None,
        "code": "server_overloaded",
    }


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (PromptTooLongError("too long: 300 > 256"), 400, "context_length_exceeded"),
        (EngineOverloadedError("busy", retry_after_s=1), 503, "server_overloaded"),
        (EngineDeadError("the engine stopped"), 503, "engine_unavailable"),
        (InvalidRequestError("prompt token ids must be in [0, 100)"), 400, None),
    ],
)
async def test_submit_errors_map_through_the_table(
    make_app: AppFactory, fake_engine: FakeEngine, error: Exception, status: int, code: str | None
) -> None:
    fake_engine.submit_error = error  # type: ignore[assignment]
    async with client_for(make_app()) as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["message"] == str(error)


async def test_context_length_is_checked_before_submit(
    client: httpx.AsyncClient, fake_engine: FakeEngine
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(max_tokens=1000))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "256" in error["message"] and "1000 in the completion" in error["message"]
    assert fake_engine.submitted == []


async def test_completions_prompt_validation(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [999]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_chat_template_rejection_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "reject me"}])
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"
    assert "template" in r.json()["error"]["message"]


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model="gpt-4"))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert "gpt-4" in r.json()["error"]["message"]


# -- tenancy seam ---------------------------------------------------------------------------------


async def test_tenancy_authenticates_admits_and_settles(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    tenancy = FakeTenancy()
    async with client_for(make_app(tenancy=tenancy)) as c:
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert fake_engine.submitted == []

        r = await c.post(
            "/v1/chat/completions", json=chat(max_tokens=4, n=2), headers={"Authorization": "Bearer sk-good"}
        )
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "10"
        (request,) = fake_engine.submitted
        assert request.priority is Priority.FREE and request.fairness_key == "acme"
        assert request.queue_deadline_s == 7.0
        num_prompt = len(request.prompt_token_ids)
        assert tenancy.admitted == [("acme", num_prompt, 8, r.json()["id"])]
        assert tenancy.settled == [(r.json()["id"], num_prompt, 8)]

        r = await c.post(
            "/v1/chat/completions", json=chat(stream=True), headers={"Authorization": "Bearer sk-good"}
        )
        assert r.status_code == 200
        assert tenancy.settled[-1][2] == 8  # settled after the stream ended, with what it used

        tenancy.refuse = FakeDecision(admitted=False, reason="tokens", retry_after_s=4)
        r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-good"})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "4"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"

        tenancy.refuse = FakeDecision(admitted=False, reason="unavailable")
        r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-good"})
        assert r.status_code == 503 and "retry-after" in r.headers


async def test_refused_by_engine_after_admission_is_refunded(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    tenancy = FakeTenancy()
    fake_engine.submit_error = EngineOverloadedError("busy")
    async with client_for(make_app(tenancy=tenancy)) as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-good"})
    assert r.status_code == 503
    assert [(p, c) for _, p, c in tenancy.settled] == [(0, 0)]  # nothing used: the whole reservation back


async def test_open_mode_uses_user_as_fairness_key(
    client: httpx.AsyncClient, fake_engine: FakeEngine
) -> None:
    await client.post("/v1/chat/completions", json=chat(user="alice"))
    assert fake_engine.submitted[0].fairness_key == "alice"
