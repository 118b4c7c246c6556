"""Background responses: created `queued`, polled to their end, cancelled (everything released),
and their state shared through the store: another gateway over the same Redis sees a run, cancels
it, and reads a run whose gateway died as `failed` (its lease lapsed), never "not found"."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseErrorEvent

from gateway.responses.background import DRAINED, LAPSED
from gateway.responses.redis_store import RedisStore
from gateway.responses.store import StoredResponse
from tests.gateway.conftest import AppFactory, TinyServer, client_for, stream_through
from tests.gateway.fakes import FakeEngine

FINAL = ("completed", "incomplete", "cancelled", "failed")


def _poll(client: openai.OpenAI, response_id: str, timeout_s: float = 60.0) -> Response:
    deadline = time.monotonic() + timeout_s
    while True:
        resp = client.responses.retrieve(response_id)
        if resp.status in FINAL:
            return resp
        assert time.monotonic() < deadline, f"still {resp.status} after {timeout_s} s"
        time.sleep(0.05)


def test_a_background_response_runs_after_the_client_left(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    queued = client.responses.create(
        model=tiny_server.model, input="Count to ten.", background=True, max_output_tokens=8, temperature=0
    )
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _poll(client, queued.id)
    assert done.status == "incomplete" and done.background is True and done.id == queued.id
    assert done.usage is not None and done.usage.output_tokens == 8 and done.output_text
    assert client.responses.cancel(queued.id).status == "incomplete"  # a finished one: as it is
    tiny_server.wait_idle()


def test_cancel_releases_the_run(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    queued = client.responses.create(
        model=tiny_server.model, input="Write a long story.", background=True, max_output_tokens=900
    )
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert client.responses.retrieve(queued.id).status == "cancelled"
    tiny_server.wait_idle()  # its sequence, KV blocks and slot are free
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent
    foreground = client.responses.create(model=tiny_server.model, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


async def _status(client: Any, response_id: str) -> dict[str, Any]:
    r = await client.get(f"/v1/responses/{response_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_another_gateway_sees_and_cancels_a_run(
    make_app: AppFactory, fake_engine: FakeEngine, redis_url: str
) -> None:
    fake_engine.gate = asyncio.Event()  # the run stays in progress until cancelled
    # Renewed every third of the lease: 1 s outlasts a 0.6 s stall of this loop. A full GC pass of
    # the test process (the suite's objects, a real model's among them) took 0.37-0.72 s here.
    lease = {"redis_url": redis_url, "responses_background_lease_s": 1.0}
    async with client_for(make_app(**lease)) as a, client_for(make_app(**lease)) as b:
        r = await a.post("/v1/responses", json={"model": "fake-model", "input": "hi", "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        response_id = r.json()["id"]
        deadline = time.monotonic() + 10
        while (await _status(b, response_id))["status"] != "in_progress":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.2)  # longer than the lease: the running gateway keeps renewing it
        assert (await _status(b, response_id))["status"] == "in_progress"
        r = await b.post(f"/v1/responses/{response_id}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        while response_id not in fake_engine.aborted:  # gateway A saw the mark and ended the run
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert fake_engine.num_active == 0
        assert (await _status(a, response_id))["status"] == "cancelled"


async def test_a_run_whose_gateway_died_reads_failed(make_app: AppFactory, redis_url: str) -> None:
    store = RedisStore(redis_url, ttl_s=600, max_num_responses=10)
    response = {"id": "resp_dead", "object": "response", "status": "in_progress", "background": True}
    # What a gateway killed mid-run leaves: its last renewal, a lease that has since lapsed.
    await store.put("", "resp_dead", StoredResponse(response, [], [], time.time() - 1).dumps())
    async with client_for(make_app(redis_url=redis_url)) as b:
        body = await _status(b, "resp_dead")
        assert body["status"] == "failed" and body["error"]["message"] == LAPSED
        r = await b.post("/v1/responses/resp_dead/cancel")
        assert r.status_code == 200 and r.json()["status"] == "failed"
    await store.aclose()


def _events(chunk: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in chunk.decode().splitlines() if line.startswith("data: {")]


async def test_a_drain_deadline_ends_streams_and_runs_in_responses_shapes(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    fake_engine.gate = asyncio.Event()
    app = make_app(keep_alive_s=0.1)
    body = {"model": "fake-model", "input": "hi"}
    async with client_for(app) as client:
        queued = (await client.post("/v1/responses", json={**body, "background": True})).json()
        chunks, handler = await stream_through(app, "/v1/responses", {**body, "stream": True})
        seen: list[dict[str, Any]] = []
        while not seen or seen[-1]["type"] != "response.in_progress":
            seen += _events(await asyncio.wait_for(chunks.get(), 10))
        app.state.gateway.drain.stop_all()
        await asyncio.wait_for(handler, 10)
        rest = b"".join(chunks.get_nowait() for _ in range(chunks.qsize())).decode()
        error = ResponseErrorEvent.model_validate(_events(rest.encode())[-1], strict=True)
        assert error.type == "error" and error.sequence_number == seen[-1]["sequence_number"] + 1
        assert rest.rstrip().endswith("data: [DONE]") and "event: error" in rest
        deadline = time.monotonic() + 10
        while (await _status(client, queued["id"]))["status"] != "failed":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert (await _status(client, queued["id"]))["error"]["message"] == DRAINED
        assert fake_engine.num_active == 0
