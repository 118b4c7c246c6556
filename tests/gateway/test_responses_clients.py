"""Clients that speak the Responses API, unchanged but for base_url, against a real server (the
tiny random-weight model, so tool calls are forced: a 2-layer random model has no judgement):
the OpenAI Agents SDK with its default Responses model, and LangChain's ChatOpenAI with
`use_responses_api=True`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from tests.gateway.conftest import TinyServer


class Report(BaseModel):
    summary: str


async def test_an_agent_completes_a_tool_round_trip_and_a_second_turn(tiny_server: TinyServer) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's trace API
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=tiny_server.model, openai_client=client),
        # Forced on the first call; the SDK resets it to auto after the tool ran (reset_tool_choice),
        # and at temperature 0 this random model then answers (in the output type's JSON schema,
        # which closes before max_tokens; free text from random weights would run to the limit).
        output_type=Report,
        model_settings=ModelSettings(
            tool_choice="get_weather", max_tokens=40, parallel_tool_calls=False, temperature=0
        ),
    )
    first = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    assert len(calls) == 1 and isinstance(first.final_output, Report)
    kinds = [item.type for item in first.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert first.last_response_id is not None and first.last_response_id.startswith("resp_")
    # The tool's output went back to the model: the last call's input items hold it.
    last = await client.responses.input_items.list(first.last_response_id, order="asc")
    outputs = [item for item in last.data if item.type == "function_call_output"]
    assert [o.output for o in outputs] == [f"sunny in {calls[0]}"]  # type: ignore[union-attr]
    # A second turn on top of the stored first: only the new question is sent.
    second = await Runner.run(agent, "And in Rome?", previous_response_id=first.last_response_id, max_turns=3)
    assert len(calls) == 2 and isinstance(second.final_output, Report)
    assert second.last_response_id not in (None, first.last_response_id)
    await client.close()
    tiny_server.wait_idle()


class Weather(BaseModel):
    city: str
    celsius: int


def test_langchain_with_the_responses_api(tiny_server: TinyServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=tiny_server.model,
        base_url=tiny_server.base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        use_responses_api=True,
        max_tokens=60,  # type: ignore[call-arg]
        max_retries=0,
    )
    message: Any = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    # Through chat completions too, the call's arguments hold only the declared keys (LangChain's
    # schemas do not set additionalProperties; a random model used to add keys of its own).
    chat_llm = ChatOpenAI(
        model=tiny_server.model,
        base_url=tiny_server.base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_tokens=60,  # type: ignore[call-arg]
        max_retries=0,
        temperature=1.0,
    )
    for _ in range(3):
        reply: Any = chat_llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
        assert reply.tool_calls and all(set(c["args"]) == {"city"} for c in reply.tool_calls)
    structured = llm.with_structured_output(Weather, method="json_schema").invoke("Paris, as JSON.")
    assert isinstance(structured, Weather)
    text = llm.invoke("Hi")
    assert isinstance(text.content, list | str) and json.dumps(text.content)
    tiny_server.wait_idle()


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_AGENTS_DISABLE_TRACING"):
        monkeypatch.delenv(name, raising=False)
