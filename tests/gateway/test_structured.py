"""Structured outputs and tool calls end to end: the official openai SDK against a real server over
the bundled SmolLM2-135M (parse() with a pydantic model, a tools round trip streamed and not, the
SDK's stream helper assembling streamed calls)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from gateway.openai.tools import MAX_PARALLEL_TOOL_CALLS
from tests.gateway.conftest import TinyServer

pytestmark = pytest.mark.real_model


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture
def client(real_server: TinyServer) -> Iterator[openai.OpenAI]:
    yield real_server.openai(timeout=120)
    real_server.wait_idle()


def test_parse_returns_the_pydantic_object(client: openai.OpenAI, real_server: TinyServer) -> None:
    messages: Any = [
        {
            "role": "user",
            "content": "What is the capital of France? Answer in JSON with its name, country and population.",
        }
    ]
    r = client.chat.completions.parse(
        model=real_server.model, messages=messages, response_format=City, temperature=0, max_tokens=80
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    # Sampled, several choices, logprobs: every one is valid by construction.
    r = client.chat.completions.parse(
        model=real_server.model,
        messages=messages,
        response_format=City,
        temperature=1.0,
        top_p=0.9,
        n=3,
        seed=7,
        logprobs=True,
        max_tokens=80,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
        assert choice.logprobs is not None and choice.logprobs.content


WEATHER_TOOLS: Any = [openai.pydantic_function_tool(GetWeather)]
QUESTION: Any = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def _tool_result(call: Any) -> dict[str, Any]:
    args = GetWeather.model_validate_json(call.function.arguments)
    return {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args.city, "temp": 18})}


def test_tools_round_trip(client: openai.OpenAI, real_server: TinyServer) -> None:
    args: dict[str, Any] = dict(model=real_server.model, tools=WEATHER_TOOLS, temperature=0, max_tokens=80)
    first = client.chat.completions.create(
        messages=QUESTION, tool_choice="required", parallel_tool_calls=False, **args
    )
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "GetWeather"
    history = [*QUESTION, choice.message, _tool_result(call)]
    final = client.chat.completions.create(messages=history, tool_choice="none", **args)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_stream_helper_assembles_streamed_tool_calls(client: openai.OpenAI, real_server: TinyServer) -> None:
    args: dict[str, Any] = dict(model=real_server.model, tools=WEATHER_TOOLS, temperature=0, max_tokens=160)
    with client.chat.completions.stream(messages=QUESTION, tool_choice="required", **args) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert 1 <= len(calls) <= MAX_PARALLEL_TOOL_CALLS
    assert all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)
    call = calls[0]
    # The same call, not streamed (greedy): the stream assembled exactly the whole response.
    whole = client.chat.completions.create(messages=QUESTION, tool_choice="required", **args)
    assert whole.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    history = [*QUESTION, choice.message, *[_tool_result(c) for c in calls]]
    # The answer, streamed (no tools this time: the helper refuses a strict-tools answer cut at max_tokens).
    answer: dict[str, Any] = dict(model=real_server.model, temperature=0, max_tokens=80)
    with client.chat.completions.stream(messages=history, **answer) as stream:
        text = "".join(event.delta for event in stream if event.type == "content.delta")
    assert text and text == stream.get_final_completion().choices[0].message.content


def test_auto_lets_the_model_answer_in_text_or_call(client: openai.OpenAI, real_server: TinyServer) -> None:
    r = client.chat.completions.create(
        model=real_server.model, messages=QUESTION, tools=WEATHER_TOOLS, temperature=0, max_tokens=80
    )
    message = r.choices[0].message
    if message.tool_calls:  # a call, once started, is constrained: its arguments validate
        assert r.choices[0].finish_reason == "tool_calls"
        GetWeather.model_validate_json(message.tool_calls[0].function.arguments)
    else:
        assert message.content and not message.content.startswith("<")


def test_langchain_structured_output_and_bound_tools(real_server: TinyServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=real_server.base_url + "/v1",
        api_key="unused",
        model=real_server.model,
        temperature=0,
        max_tokens=80,
    )
    city = llm.with_structured_output(City).invoke(
        "What is the capital of France? Give its name, country, population."
    )
    assert isinstance(city, City)
    message = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(QUESTION[0]["content"])
    (call,) = message.tool_calls[:1]
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    real_server.wait_idle()


class Story(BaseModel):
    title: str
    text: str  # no bound: only the budget ends it


def test_parse_gets_a_closed_object_when_the_model_would_run_past_max_tokens(
    client: openai.OpenAI, real_server: TinyServer
) -> None:
    """Biased against every token that starts with a quote, the model would never end a string on
    its own, and parse() raises on a cut output (LengthFinishReasonError). Near max_tokens the
    output is steered to close, so the SDK gets a whole object with finish_reason "stop"."""
    tokenizer = real_server.engine.tokenizer
    quotes = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).startswith('"')]
    assert 10 < len(quotes) < 300  # the bias is OpenAI's shape: at most 300 entries
    messages: Any = [{"role": "user", "content": "Write a long story as JSON with a title and a text."}]
    args: dict[str, Any] = dict(model=real_server.model, messages=messages, response_format=Story)
    bias = {str(i): -100 for i in quotes}
    r = client.chat.completions.parse(**args, temperature=0, max_tokens=60, logit_bias=bias)
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Story)
    assert r.usage is not None and r.usage.completion_tokens <= 60
    assert len(choice.message.parsed.title) + len(choice.message.parsed.text) > 20  # it ran, then closed
