"""The Responses API's WebSocket mode (gateway/responses/websocket.py).

The official openai SDK's `client.responses.connect()`, unchanged but for base_url, against a real
server (uvicorn, the real engine with the tiny model): turns in sequence on one socket, continued
with `previous_response_id` from the store and, with `store: false`, from the socket's own cache;
an unknown id is an error event that leaves the socket usable. Starlette's test client over the app
with the fake engine: the upgrade's key, the per-tenant cap, background refused, the drain's close
code. A client that does not read: its turn is ended (the engine sequence aborted) and the socket
closed 1008, the engine never waiting for it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from gateway.responses.websocket import CLOSE_POLICY, CLOSE_RESTART
from tests.gateway.conftest import AppFactory, TinyServer
from tests.gateway.fakes import FakeDecision, FakeEngine, FakeTenancy


def _turn(conn: Any) -> tuple[Any, list[str]]:
    """The events of one turn, up to its terminal event (or error): that event and the kinds seen."""
    kinds = []
    for event in conn:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return event, kinds
    raise AssertionError(f"socket closed mid-turn after {kinds}")


def test_the_sdk_runs_turns_over_one_socket(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    model = tiny_server.model
    with client.responses.connect() as conn:
        conn.response.create(model=model, input="first turn", max_output_tokens=4, temperature=0)
        done, kinds = _turn(conn)
        assert kinds[0] == "response.created" and "response.output_text.delta" in kinds, kinds
        first = done.response
        assert first.id.startswith("resp_") and done.type in ("response.completed", "response.incomplete")
        # The second turn sends only its new input; the history comes from the store.
        conn.response.create(
            model=model, input="second turn", previous_response_id=first.id, max_output_tokens=4
        )
        done, _ = _turn(conn)
        second = done.response
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is in the prompt
        # store false: not in the store, yet this socket continues from it (its cache).
        conn.response.create(
            model=model, input="third", previous_response_id=second.id, store=False, max_output_tokens=4
        )
        third = _turn(conn)[0].response
        conn.response.create(
            model=model, input="fourth", previous_response_id=third.id, store=False, max_output_tokens=4
        )
        fourth = _turn(conn)[0].response
        assert fourth.usage.input_tokens > third.usage.input_tokens > second.usage.input_tokens
        # An unknown id: OpenAI's error event, and the socket still takes turns.
        conn.response.create(model=model, input="x", previous_response_id="resp_nope", max_output_tokens=4)
        error, kinds = _turn(conn)
        assert kinds == ["error"] and error.status == 400, error
        assert (
            error.error.code == "previous_response_not_found" and error.error.param == "previous_response_id"
        )
        conn.response.create(model=model, input="still here", max_output_tokens=4, stream_id="lane-1")
        done, _ = _turn(conn)
        assert done.type in ("response.completed", "response.incomplete") and done.stream_id == "lane-1"
    # Over HTTP the stored turns are there; the store: false ones are not (the socket kept them).
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    # Over HTTP an unknown previous_response_id is the same code (a 400, as OpenAI's).
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="x", previous_response_id="resp_nope", max_output_tokens=4)
    assert (
        refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
    )
    tiny_server.wait_idle()


def test_a_failed_continuation_evicts_what_it_continued(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    with client.responses.connect() as conn:
        conn.response.create(model=tiny_server.model, input="a", store=False, max_output_tokens=2)
        first = _turn(conn)[0].response
        # Refused (a bad temperature) while continuing `first`: `first` leaves the socket's cache.
        conn.response.create(
            model=tiny_server.model, input="b", previous_response_id=first.id, temperature=9.0
        )
        assert _turn(conn)[0].error.param == "temperature"
        conn.response.create(model=tiny_server.model, input="c", previous_response_id=first.id)
        error = _turn(conn)[0]
        assert error.error.code == "previous_response_not_found", error
    tiny_server.wait_idle()


# -- the upgrade, the caps and the drain (the app with the fake engine, in process) ---------------


def _create(**fields: Any) -> str:
    # Not stored: the fake tenancy has no plans for the store's bounds.
    body = {"type": "response.create", "model": "fake-model", "input": "hi", "store": False, **fields}
    return json.dumps(body)


def _until_terminal(ws: Any) -> list[dict[str, Any]]:
    events = []
    while True:
        events.append(json.loads(ws.receive_text()))
        if events[-1]["type"] in ("response.completed", "response.failed", "error"):
            return events


def test_the_upgrade_is_authenticated_and_capped_per_tenant(make_app: AppFactory) -> None:
    tenancy = FakeTenancy()
    app = make_app(tenancy=tenancy, websocket_max_open=1, max_body_bytes=4096)
    with TestClient(app) as client:
        with pytest.raises(Exception) as refused:
            with client.websocket_connect("/v1/responses", headers={"Authorization": "Bearer sk-bad"}):
                pass
        assert refused.value.status_code == 401  # type: ignore[attr-defined]
        assert refused.value.json()["error"]["code"] == "invalid_api_key"  # type: ignore[attr-defined]
        good = {"Authorization": "Bearer sk-good"}
        with client.websocket_connect("/v1/responses", headers=good) as ws:
            # One socket is the cap: a second is refused before the upgrade, in OpenAI's shape.
            with pytest.raises(Exception) as capped:
                with client.websocket_connect("/v1/responses", headers=good):
                    pass
            assert capped.value.status_code == 429  # type: ignore[attr-defined]
            assert capped.value.json()["error"]["code"] == "websocket_limit_exceeded"  # type: ignore[attr-defined]
            ws.send_text(_create(background=True, store=True))
            refused_turn = json.loads(ws.receive_text())
            assert refused_turn["type"] == "error" and refused_turn["error"]["param"] == "background"
            assert refused_turn["error"]["code"] == "invalid_request"  # the event's code is never null
            ws.send_text(json.dumps({"type": "response.steer", "input": "x", "previous_response_id": "r"}))
            assert json.loads(ws.receive_text())["error"]["param"] == "type"
            ws.send_text("not json")
            assert json.loads(ws.receive_text())["status"] == 400
            ws.send_text("[" * 200 + "]" * 200)  # nested past the limit, as a POST's body
            assert json.loads(ws.receive_text())["status"] == 400
            ws.send_text(_create(input="x" * 5000))  # over this app's max_body_bytes
            too_large = json.loads(ws.receive_text())
            assert too_large["status"] == 413 and too_large["error"]["code"] == "request_too_large"
            ws.send_text(_create())
            events = _until_terminal(ws)
            assert [e["type"] for e in events][0] == "response.created"
            assert events[-1]["type"] == "response.completed"
            # Admitted and settled as an HTTP turn: the tenant's hold, with the tokens it used.
            response = events[-1]["response"]
            assert tenancy.admitted[-1][0] == "acme"
            assert tenancy.settled[-1][1:] == (
                response["usage"]["input_tokens"],
                response["usage"]["output_tokens"],
            )
            # The tenant's limits refuse a turn as they refuse a POST; the socket takes the next.
            tenancy.refuse = FakeDecision(admitted=False, reason="tokens", retry_after_s=4)
            ws.send_text(_create())
            limited = json.loads(ws.receive_text())
            assert limited["status"] == 429 and limited["error"]["code"] == "rate_limit_exceeded"
            tenancy.refuse = None
            assert app.state.gateway.sockets.open.num_open("acme") == 1
        # Closed: its place is free again.
        with client.websocket_connect("/v1/responses", headers=good) as ws:
            ws.send_text(_create())
            assert _until_terminal(ws)[-1]["type"] == "response.completed"
        metrics = client.get("/metrics").text
        assert "batchgate_responses_websocket_turns_total 2.0" in metrics


def test_a_drain_closes_sockets_with_a_code_clients_reconnect_on(make_app: AppFactory) -> None:
    app = make_app()
    drain = app.state.gateway.drain
    with TestClient(app) as client:
        with client.websocket_connect("/v1/responses") as ws:
            ws.send_text(_create())
            assert _until_terminal(ws)[-1]["type"] == "response.completed"
            ws.portal.call(drain.begin)  # on the socket's own event loop
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
            assert closed.value.code == CLOSE_RESTART
        with pytest.raises(Exception) as refused:  # a new socket while draining: 503, retry elsewhere
            with client.websocket_connect("/v1/responses"):
                pass
        assert refused.value.status_code == 503  # type: ignore[attr-defined]


class _Unread:
    """A WebSocket whose client sends one turn, then never reads (every send waits forever)."""

    def __init__(self, frame: str) -> None:
        self.headers: dict[str, str] = {}
        self.frames = [frame]
        self.closed: tuple[int, str] | None = None
        self.gone = asyncio.Event()

    async def accept(self) -> None:
        return None

    async def receive(self) -> dict[str, Any]:
        if self.frames:
            return {"type": "websocket.receive", "text": self.frames.pop()}
        await self.gone.wait()
        return {"type": "websocket.disconnect"}

    async def send_text(self, text: str) -> None:
        await asyncio.Event().wait()  # the client does not read

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason or "")


async def test_a_client_that_does_not_read_is_closed_and_its_turn_ended(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    fake_engine.reply = lambda request, index: "word " * 400
    app = make_app(websocket_send_buffer_bytes=2048)
    socket = _Unread(_create(max_output_tokens=150))
    async with asyncio.timeout(10):
        await app.state.gateway.sockets.serve(socket)
    assert socket.closed is not None and socket.closed[0] == CLOSE_POLICY, socket.closed
    assert "reads too slowly" in socket.closed[1]
    assert len(fake_engine.aborted) == 1  # the engine's sequence was ended, not left waiting
    assert app.state.gateway.sockets.open.num_open("") == 0
