"""The error table, and that every way a request can go wrong comes back in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest

from engine.types import (
    DuplicateRequestError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    GenerationFailedError,
    InvalidRequestError,
    PromptTooLongError,
)
from gateway.errors import ENGINE_ERROR_KINDS, ERROR_TABLE, APIError, ErrorKind, from_engine_error
from tests.gateway.conftest import AppFactory, client_for
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import validate

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def test_table_statuses() -> None:
    statuses = {kind: spec.status for kind, spec in ERROR_TABLE.items()}
    assert set(statuses) == set(ErrorKind)
    assert statuses[ErrorKind.INVALID_REQUEST] == 400
    assert statuses[ErrorKind.INVALID_API_KEY] == 401
    assert ERROR_TABLE[ErrorKind.INVALID_API_KEY].type == "authentication_error"
    assert ERROR_TABLE[ErrorKind.MODEL_NOT_FOUND] == ERROR_TABLE[ErrorKind.MODEL_NOT_FOUND].__class__(
        404, "invalid_request_error", "model_not_found"
    )
    assert (
        statuses[ErrorKind.RATE_LIMITED] == 429
        and ERROR_TABLE[ErrorKind.RATE_LIMITED].code == "rate_limit_exceeded"
    )
    assert (
        statuses[ErrorKind.OVERLOADED] == 503
        and ERROR_TABLE[ErrorKind.OVERLOADED].code == "server_overloaded"
    )
    # Only our own bugs (and a failed forward pass) are 500s.
    assert {k for k, s in statuses.items() if s >= 500 and s != 503} == {
        ErrorKind.INTERNAL,
        ErrorKind.GENERATION_FAILED,
    }


@pytest.mark.parametrize(
    ("error", "status", "code", "retry_after"),
    [
        (PromptTooLongError("long"), 400, "context_length_exceeded", None),
        (EngineOverloadedError("busy", retry_after_s=0.2), 503, "server_overloaded", "1"),
        (EngineOverloadedError("busy", retry_after_s=7.5), 503, "server_overloaded", "8"),
        (EngineDeadError("dead"), 503, "engine_unavailable", "5"),
        (GenerationFailedError("boom"), 500, "generation_failed", None),
        # OpenAI's invalid_request_error carries no code
        (InvalidRequestError("prompt token ids must be in [0, 100)"), 400, None, None),
    ],
)
def test_engine_errors_by_code(
    error: EngineError, status: int, code: str | None, retry_after: str | None
) -> None:
    api = from_engine_error(error, param="messages")
    assert (api.status, api.body()["error"]["code"]) == (status, code)
    assert api.response_headers().get("Retry-After") == retry_after
    assert api.body()["error"]["param"] == ("messages" if status == 400 else None)
    assert error.code in ENGINE_ERROR_KINDS


def test_an_invalid_request_keeps_its_message_and_names_its_field() -> None:
    error = InvalidRequestError("logit_bias token ids must be in [0, 100)", param="logit_bias")
    api = from_engine_error(error, param="prompt")
    assert api.body()["error"] == {
        "message": "logit_bias token ids must be in [0, 100)",
        "type": "invalid_request_error",
        "param": "logit_bias",
        "code": None,
    }
    unnamed = from_engine_error(InvalidRequestError("empty"), param="prompt")
    assert unnamed.body()["error"]["param"] == "prompt"


def test_a_duplicate_request_id_is_our_bug() -> None:
    api = from_engine_error(DuplicateRequestError("request_id 'x' is already in the engine"))
    assert api.kind is ErrorKind.INTERNAL and "already" not in api.body()["error"]["message"]


def test_unmapped_engine_code_is_internal() -> None:
    class NewError(EngineError):
        code = "something_new"

    api = from_engine_error(NewError("x"))
    assert api.kind is ErrorKind.INTERNAL and api.status == 500


def test_error_body_shape() -> None:
    body = APIError(ErrorKind.INVALID_REQUEST, "bad n", param="n").body()
    validate(body, "Error")
    assert body == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}
    }


async def test_routing_errors_are_openai_shaped(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nothing-here")
    assert r.status_code == 404
    validate(r.json(), "Error")
    assert r.json()["error"]["code"] == "not_found" and "/v1/nothing-here" in r.json()["error"]["message"]

    r = await client.get("/v1/chat/completions")
    assert r.status_code == 405
    validate(r.json(), "Error")
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"

    r = await client.delete("/v1/models")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "headers", "status", "text"),
    [
        (b"{not json", {"content-type": "application/json"}, 400, "could not parse the JSON"),
        (b"", {"content-type": "application/json"}, 400, "empty"),
        (b'{"model": NaN}', {"content-type": "application/json"}, 400, "NaN is not valid JSON"),
        (b"\xff\xfe{}", {"content-type": "application/json"}, 400, "could not parse"),
        (b"[" * 100_000 + b"]" * 100_000, {"content-type": "application/json"}, 400, "could not parse"),
        (b"null", {"content-type": "application/json"}, 400, "JSON object"),
        (
            b'{"model": "fake-model", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            {"content-type": "application/json"},
            400,
            "unpaired surrogate",
        ),
        (b"model=x", {"content-type": "application/x-www-form-urlencoded"}, 415, "application/json"),
        (b"{}", {"content-type": "text/plain"}, 415, "text/plain"),
    ],
)
async def test_malformed_bodies(
    client: httpx.AsyncClient, content: bytes, headers: dict[str, str], status: int, text: str
) -> None:
    r = await client.post("/v1/chat/completions", content=content, headers=headers)
    assert r.status_code == status
    validate(r.json(), "Error")
    assert text in r.json()["error"]["message"]


async def test_body_without_content_type_is_parsed(client: httpx.AsyncClient) -> None:
    import json

    r = await client.post("/v1/chat/completions", content=json.dumps(BODY).encode())
    assert r.status_code == 200


async def test_escaped_surrogate_pairs_are_fine(client: httpx.AsyncClient) -> None:
    # A paired escape is one character; an escaped backslash before "ud800" is just text.
    content = b'"\\ud83d\\ude00 and \\\\ud800"'
    body = b'{"model": "fake-model", "messages": [{"role": "user", "content": ' + content + b"}]}"
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200


async def test_oversized_body_is_413(make_app: AppFactory) -> None:
    async with client_for(make_app(max_body_bytes=1000)) as c:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 2000}]}
        r = await c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413
        validate(r.json(), "Error")
        assert (
            r.json()["error"]["code"] == "request_too_large" and "1000 bytes" in r.json()["error"]["message"]
        )

        async def chunks():  # no Content-Length: counted while reading
            for _ in range(3):
                yield b"x" * 600

        r = await c.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert (await c.post("/v1/chat/completions", json=BODY)).status_code == 200


async def test_unexpected_exception_is_a_generic_500(make_app: AppFactory, fake_engine: FakeEngine) -> None:
    def broken(request: object, index: int) -> str:  # a bug inside the server
        raise RuntimeError("secret internal detail")

    fake_engine.reply = broken
    transport = httpx.ASGITransport(app=make_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text


async def test_client_leaving_during_upload_is_not_a_server_error(make_app: AppFactory) -> None:
    from tests.gateway.helpers import ASGICall

    call = ASGICall(make_app(), "/v1/chat/completions", BODY)
    messages = iter(
        [{"type": "http.request", "body": b'{"mo', "more_body": True}, {"type": "http.disconnect"}]
    )

    async def receive() -> dict:
        return next(messages)

    call.receive = receive  # type: ignore[method-assign]
    await call.start().task
    assert call.sent[0]["status"] == 400
    assert b"disconnected while sending" in call.body
