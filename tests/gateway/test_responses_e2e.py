"""The Responses API end to end: the official `openai` SDK against a real server (uvicorn, the real
engine with the tiny random-weight model), for create, stream, parse, tools, continuation and the
stored-response routes. Shapes are checked by the SDK's own pydantic types (strict validation of
every body and event), not by our schemas."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.gateway.conftest import TinyServer
from tests.gateway.helpers import validate

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
def client(tiny_server: TinyServer) -> openai.OpenAI:
    return tiny_server.openai()


def _strict(body: dict[str, Any]) -> Response:
    """The body as the SDK's Response model, validated (the SDK itself only constructs)."""
    return Response.model_validate(body, strict=False)


def test_create_text_in_openai_shapes(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    raw = client.responses.with_raw_response.create(
        model=tiny_server.model,
        instructions="Answer briefly.",
        input="What is the capital of France?",
        max_output_tokens=8,
        temperature=0,
        metadata={"case": "text"},
    )
    body = json.loads(raw.text)
    resp = _strict(body)
    validate(body, "Response")
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"  # random weights run to the limit
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage is not None and resp.usage.output_tokens == 8
    assert resp.usage.total_tokens == resp.usage.input_tokens + 8
    assert resp.instructions == "Answer briefly." and resp.metadata == {"case": "text"}
    assert resp.output_text and raw.headers["x-request-id"] == resp.id
    tiny_server.wait_idle()


def test_stream_assembles_what_create_answers(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    fields: dict[str, Any] = {
        "model": tiny_server.model,
        "input": "Say hi.",
        "max_output_tokens": 6,
        "temperature": 0,
    }
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    # (the SDK's get_final_response() takes only `response.completed`; this one ran to its limit)
    final = events[-1].response  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    for e in events:
        EVENTS.validate_python(e.model_dump(mode="json", exclude_unset=True))
        validate(e.model_dump(mode="json", exclude_unset=True), "ResponseStreamEvent")  # our document
    assert final.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    tiny_server.wait_idle()


def test_a_forced_function_call_round_trips_through_previous_response_id(
    client: openai.OpenAI, tiny_server: TinyServer
) -> None:
    first = client.responses.create(
        model=tiny_server.model,
        input="Weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and first.status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}  # the schema, and no keys beyond it
    second = client.responses.create(
        model=tiny_server.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The second prompt starts with the first turn's prompt and output: the prefix cache serves it.
    assert first.usage is not None and second.usage is not None
    first_turn = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > first_turn
    # Every full 16-token block of it (the re-rendered call tokenizes as it was generated).
    assert second.usage.input_tokens_details.cached_tokens >= first_turn // 16 * 16
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    assert items.data[0].call_id == calls[0].call_id  # type: ignore[union-attr]
    tiny_server.wait_idle()


def test_a_streamed_function_call_assembles(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    with client.responses.stream(
        model=tiny_server.model,
        input="Weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments).keys() == {"city"}
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments
    [call] = final.output
    assert call.type == "function_call" and call.arguments == done[0].arguments
    tiny_server.wait_idle()


class City(BaseModel):
    name: str
    population: int


def test_parse_with_a_pydantic_model(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    parsed = client.responses.parse(
        model=tiny_server.model, input="A city, as JSON.", text_format=City, max_output_tokens=60
    )
    assert isinstance(parsed.output_parsed, City)
    tiny_server.wait_idle()


def test_retrieve_delete_and_input_items(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    created = client.responses.create(
        model=tiny_server.model,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "One"}]},
            {"role": "assistant", "content": "Two"},
            {"role": "user", "content": "Three"},
        ],
        max_output_tokens=2,
    )
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    page = client.responses.input_items.list(created.id, limit=2, order="asc")
    validate(page.model_dump(mode="json", exclude_unset=True), "ResponseItemList")
    assert [i.role for i in page.data] == ["developer", "user"] and page.has_more  # type: ignore[union-attr]
    rest = client.responses.input_items.list(created.id, after=page.last_id, order="asc")
    assert [i.role for i in rest.data] == ["assistant", "user"] and not rest.has_more  # type: ignore[union-attr]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as gone:  # OpenAI's 400 previous_response_not_found
        client.responses.create(model=tiny_server.model, input="x", previous_response_id=created.id)
    assert gone.value.code == "previous_response_not_found"
    unstored = client.responses.create(model=tiny_server.model, input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_tokens_counts_what_create_is_charged(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    fields: dict[str, Any] = {"model": tiny_server.model, "instructions": "Be brief.", "input": "Count me."}
    counted = client.responses.input_tokens.count(**fields, tools=[WEATHER])  # type: ignore[list-item]
    created = client.responses.create(**fields, tools=[WEATHER], max_output_tokens=1)  # type: ignore[list-item]
    assert counted.object == "response.input_tokens" and created.usage is not None
    assert counted.input_tokens == created.usage.input_tokens
    plain = client.responses.input_tokens.count(**fields)
    assert plain.input_tokens < counted.input_tokens  # the tools are in the prompt
    continued = client.responses.input_tokens.count(
        **fields,
        tools=[WEATHER],  # type: ignore[list-item]
        previous_response_id=created.id,  # instructions and tools are per request; the turns are kept
    )
    assert continued.input_tokens > created.usage.input_tokens + created.usage.output_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            "input[0].content[0]",
        ),
        ({"input": "x", "colour": "red"}, "colour"),
        ({"input": "x", "background": True, "stream": True}, "stream"),
        ({"input": "x", "background": True, "store": False}, "background"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "max_output_tokens": 5000}, "input"),  # over the tiny model's 1024 window
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    tiny_server: TinyServer, fields: dict[str, Any], param: str
) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/responses", json={"model": tiny_server.model, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_ignored_fields_are_named_in_one_header(tiny_server: TinyServer) -> None:
    r = httpx.post(
        tiny_server.base_url + "/v1/responses",
        json={
            "model": tiny_server.model,
            "input": "x",
            "max_output_tokens": 1,
            "reasoning": {"effort": "low", "summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "client_metadata": {"a": "b"},
            "service_tier": "auto",
            "tools": [{"type": "web_search"}],
            "store": False,
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-batchgate-ignored"] == (
        "reasoning, client_metadata, service_tier, include=reasoning.encrypted_content, tools[0]=web_search"
    )
    assert r.json()["tools"] == []  # the hosted tool is not offered


def test_conversations_through_the_sdk(client: openai.OpenAI, tiny_server: TinyServer) -> None:
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}], metadata={"topic": "names"}
    )
    assert (
        conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    )
    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "x"}
    first = client.responses.create(
        model=tiny_server.model, conversation=conv.id, input="What is my name?", max_output_tokens=3
    )
    assert first.conversation is not None and first.conversation.id == conv.id
    second = client.responses.create(
        model=tiny_server.model, conversation={"id": conv.id}, input="Again?", max_output_tokens=3
    )
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= 16
    items = client.conversations.items.list(conv.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "Hi"}]
    )
    [new] = added.data
    assert client.conversations.items.retrieve(new.id, conversation_id=conv.id).id == new.id  # type: ignore[union-attr]
    assert client.conversations.items.delete(new.id, conversation_id=conv.id).id == conv.id  # type: ignore[union-attr]
    assert len(client.conversations.items.list(conv.id).data) == 5
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=tiny_server.model, conversation=conv.id, previous_response_id=first.id, input="x"
        )
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=tiny_server.model, conversation=conv.id, input="x")
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(first.id)  # a response's id is no conversation
    tiny_server.wait_idle()


def test_truncation_auto_drops_the_oldest_items_to_fit(
    client: openai.OpenAI, tiny_server: TinyServer
) -> None:
    turns = [{"role": "user", "content": f"Turn {i}: " + "word " * 120} for i in range(12)]
    fields: dict[str, Any] = {"model": tiny_server.model, "input": turns, "max_output_tokens": 4}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**fields)  # truncation "disabled" (the default): too long is a 400
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "input"
    assert error["code"] == "context_length_exceeded"
    assert "of max_output_tokens." in error["message"] and "max_tokens" not in error["message"]  # its field
    resp = client.responses.create(**fields, truncation="auto")
    assert resp.truncation == "auto" and resp.usage is not None

    def count(k: int) -> int:
        return client.responses.input_tokens.count(model=tiny_server.model, input=turns[-k:]).input_tokens

    fits = next(k for k in range(len(turns), 0, -1) if count(k) <= 1024 - 4)
    assert 1 < fits < len(turns) and resp.usage.input_tokens == count(fits)  # the newest that fit
    tiny_server.wait_idle()
