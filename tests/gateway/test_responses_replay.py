"""`GET /v1/responses/{id}?stream=true`: a background response's events replayed from the store, in
the shapes and sequence numbers of a streamed create, followed to the end while it runs, from
`starting_after` on; through the official SDK (`retrieve(stream=True)` and the `stream(response_id=)`
helper) against a real server, and across two gateways over one Redis."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.gateway.conftest import AppFactory, TinyServer, client_for
from tests.gateway.fakes import FakeEngine

EVENT = TypeAdapter(ResponseStreamEvent)


class Flag(BaseModel):
    ok: bool


SCHEMA = Flag.model_json_schema()


def _replay(client: openai.OpenAI, response_id: str, **kwargs: Any) -> list[dict[str, Any]]:
    with client.responses.retrieve(response_id, stream=True, **kwargs) as stream:
        return [event.model_dump(mode="json", exclude_unset=True) for event in stream]


def test_replay_follows_a_run_and_repeats_itself(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    queued = client.responses.create(
        model=tiny_server.model, input="Count.", background=True, max_output_tokens=8, temperature=0
    )
    live = _replay(client, queued.id)  # from queued (or running) to its end
    done = client.responses.retrieve(queued.id)
    assert done.status == "incomplete"
    for event in live:  # each in OpenAI's exact shape
        EVENT.validate_python(event, strict=True)
    assert [e["sequence_number"] for e in live] == list(range(len(live)))
    kinds = [e["type"] for e in live]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and live[-1]["response"]["id"] == queued.id
    assert live[0]["response"]["status"] == "queued" and live[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in live if e["type"] == "response.output_text.delta")
    assert text == done.output_text and text
    assert live[-1]["response"] == done.model_dump(mode="json", exclude_unset=True)
    assert _replay(client, queued.id) == live  # the same events, numbered the same, every time
    assert _replay(client, queued.id, starting_after=3) == live[4:]
    assert _replay(client, queued.id, starting_after=len(live) + 5) == []
    tiny_server.wait_idle()


def test_the_sdk_stream_helper_assembles_a_replay(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    queued = client.responses.create(
        model=tiny_server.model,
        input="Is it on? JSON.",
        background=True,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "flag", "schema": SCHEMA, "strict": True}},
    )
    with client.responses.stream(response_id=queued.id) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and Flag.model_validate_json(final.output_text)
    assert final.output_text == client.responses.retrieve(queued.id).output_text
    with client.responses.stream(response_id=queued.id, starting_after=2) as stream:
        numbers = [event.sequence_number for event in stream]
        assert stream.get_final_response().output_text == final.output_text
    assert numbers[0] == 3


def test_replay_errors_are_openai_shaped(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    foreground = client.responses.create(model=tiny_server.model, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.retrieve(foreground.id, stream=True)
    assert bad.value.body["param"] == "stream" and "background" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope", stream=True)
    url = f"{tiny_server.base_url}/v1/responses/{foreground.id}"
    for query, param in (("stream=true&starting_after=-1", "starting_after"), ("stream=maybe", "stream")):
        answer = httpx.get(f"{url}?{query}")
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def _sse(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


async def test_another_gateway_follows_a_run_over_redis(
    make_app: AppFactory, fake_engine: FakeEngine, redis_url: str
) -> None:
    fake_engine.gate = asyncio.Event()  # the run stays in progress until the gate opens
    # A lease that outlasts a full GC pass of the test process (0.37-0.72 s measured: see
    # test_responses_background.py), so the run reads in progress until the gate opens.
    lease = {"redis_url": redis_url, "responses_background_lease_s": 1.0}
    async with client_for(make_app(**lease)) as a, client_for(make_app(**lease)) as b:
        r = await a.post("/v1/responses", json={"model": "fake-model", "input": "hi", "background": True})
        response_id = r.json()["id"]
        deadline = time.monotonic() + 10
        while (await b.get(f"/v1/responses/{response_id}")).json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        replay = asyncio.create_task(b.get(f"/v1/responses/{response_id}?stream=true&starting_after=0"))
        done, _ = await asyncio.wait({replay}, timeout=0.5)
        assert not done  # it follows the run, which the gate holds
        fake_engine.gate.set()
        events = _sse((await asyncio.wait_for(replay, 10)).text)
        assert events[0]["type"] == "response.in_progress" and events[0]["sequence_number"] == 1
        assert events[-1]["type"] == "response.completed"
        final = (await a.get(f"/v1/responses/{response_id}")).json()
        assert events[-1]["response"] == final
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == final["output"][0]["content"][0]["text"]
