"""SSE mechanics over a fake engine: keep-alives while waiting, and a disconnect aborts the sequence."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sse import DONE, KEEP_ALIVE, EventStreamResponse
from tests.gateway.conftest import AppFactory
from tests.gateway.fakes import FakeEngine, FakeTenancy
from tests.gateway.helpers import ASGICall, parse_sse

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_keep_alive_comments_while_waiting_then_content(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    fake_engine.gate = asyncio.Event()  # the engine "thinks" until the gate opens
    call = ASGICall(make_app(keep_alive_s=0.01), "/v1/chat/completions", {**BODY, "stream": True}).start()
    await call.wait_until(lambda c: c.body.count(KEEP_ALIVE) >= 3)
    start = call.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"x-accel-buffering"] == b"no" and headers[b"cache-control"] == b"no-cache"
    fake_engine.gate.set()
    await asyncio.wait_for(call.task, 5)
    events, comments = parse_sse(call.body.decode())
    assert len(comments) >= 3 and set(comments) == {": keep-alive"}
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == "Hello 0!"
    assert fake_engine.aborted == []


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_the_sequence_and_settles(
    make_app: AppFactory, fake_engine: FakeEngine, stream: bool
) -> None:
    fake_engine.gate = asyncio.Event()
    tenancy = FakeTenancy()
    call = ASGICall(
        make_app(keep_alive_s=0.01, tenancy=tenancy), "/v1/chat/completions", {**BODY, "stream": stream}
    )
    call.scope["headers"].append((b"authorization", b"Bearer sk-good"))
    call.start()
    await call.wait_until(lambda c: bool(fake_engine.submitted) and (not stream or KEEP_ALIVE in c.body))
    call.disconnect()
    await asyncio.wait_for(call.task, 5)
    (request,) = fake_engine.submitted
    assert fake_engine.aborted == [request.request_id]
    assert fake_engine.num_active == 0
    assert fake_engine.stats().num_free_blocks == fake_engine.stats().num_total_blocks
    assert tenancy.settled == [(request.request_id, 0, 0)]  # nothing was generated: everything refunded


async def test_disconnect_mid_stream_after_tokens(make_app: AppFactory, fake_engine: FakeEngine) -> None:
    fake_engine.reply = lambda request, index: "x" * 200
    call = ASGICall(make_app(), "/v1/chat/completions", {**BODY, "stream": True})

    async def send_then_pause(message: dict) -> None:  # the client stops reading after a few chunks
        call.sent.append(message)
        call._changed.set()
        if call.body.count(b"data:") >= 5:
            await asyncio.Event().wait()

    call.send = send_then_pause  # type: ignore[method-assign]
    call.start()
    await call.wait_until(lambda c: c.body.count(b"data:") >= 5)
    call.disconnect()
    await asyncio.wait_for(call.task, 5)
    assert fake_engine.aborted == [fake_engine.submitted[0].request_id]
    assert DONE not in call.body


async def test_event_stream_closes_its_generator_on_every_path() -> None:
    closed: list[str] = []

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # never produces again
            yield b"data: 2\n\n"
        finally:
            closed.append("events")

    async def on_close() -> None:
        closed.append("on_close")

    response = EventStreamResponse(events(), keep_alive_s=10, on_close=on_close)
    disconnected = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body") == b"data: 1\n\n":
            disconnected.set()

    await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
    assert closed == ["events", "on_close"]
    assert response.disconnected


def test_keep_alive_must_be_positive() -> None:
    async def nothing():
        yield b""

    with pytest.raises(ValueError, match="keep_alive_s"):
        EventStreamResponse(nothing(), keep_alive_s=0)
