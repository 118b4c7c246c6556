"""gateway/openai/tools.py: output plans, the default tool prompt, reading calls back (whole and streamed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.types import FinishReason, GenerationRequest, GrammarSpec, SamplingParams
from gateway.openai.protocol import parse_chat_request
from gateway.openai.tools import (
    MAX_PARALLEL_TOOL_CALLS,
    ToolCallParser,
    closed_schema,
    conversation,
    parse_message,
    plan_output,
)
from tests.engine.helpers import run_all, text_of, tiny_engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TEXT = (
    "Let me check."
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","opts":{"unit":"C"}}}</tool_call>\n'
    '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>\n'
)


def chat(**fields: Any) -> Any:
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_whole_output_parses_into_openai_tool_calls() -> None:
    content, calls = parse_message(TEXT)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "opts": {"unit": "C"}},
        {"city": "Rome"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_message("no calls <here>") == ("no calls <here>", [])
    assert parse_message('<tool_call>{"name":"f","arguments":{}}</tool_call>')[0] is None


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_deltas_come_as_openai_sends_them_and_assemble_to_the_whole(step: int) -> None:
    parser = ToolCallParser()
    deltas = []
    for i in range(0, len(TEXT), step):
        deltas += parser.feed(TEXT[i : i + step], final=i + step >= len(TEXT))
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for part in d.get("tool_calls", []):
            if part["index"] not in calls:  # the first delta of a call: index, id, type, name
                assert set(part) == {"index", "id", "type", "function"}
                assert part["function"]["arguments"] == ""
                calls[part["index"]] = {"id": part["id"], "name": part["function"]["name"], "arguments": ""}
            else:  # then argument fragments only
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    whole_content, whole_calls = parse_message(TEXT)
    assert content == whole_content
    assert [c["arguments"] for c in calls.values()] == [c["function"]["arguments"] for c in whole_calls]
    assert parser.num_calls == 2
    if step == 1:  # arguments stream as they are generated, not in one piece at the end
        assert sum(1 for d in deltas if "tool_calls" in d and d["tool_calls"][0]["index"] == 0) > 3


def test_text_that_only_looks_like_a_call_start_is_held_then_released() -> None:
    parser = ToolCallParser()
    assert parser.feed("a <tool") == [{"content": "a "}]
    assert parser.feed("box>") == [{"content": "<toolbox>"}]
    assert parser.feed("<tool_c", final=True) == [{"content": "<tool_c"}]


def test_a_call_cut_off_by_max_tokens_keeps_what_it_had() -> None:
    content, calls = parse_message('<tool_call>{"name":"get_weather","arguments":{"city":"Pa')
    assert content is None and calls[0]["function"]["arguments"] == '{"city":"Pa'


def test_plans() -> None:
    assert plan_output(chat()).grammar is None
    assert plan_output(chat(response_format={"type": "json_object"})).grammar == GrammarSpec.json_object()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plan = plan_output(
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": False},
            }
        )
    )
    assert plan.grammar == GrammarSpec.json_schema(schema, strict=False)
    assert plan.checks == ((plan.grammar, "response_format.json_schema.schema"),)
    plan = plan_output(chat(tools=[WEATHER]))
    assert plan.parse_tool_calls and plan.grammar is not None and "TEXT" in plan.grammar.source  # auto
    assert [p for _, p in plan.checks] == ["tools[0].function.parameters", "tools"]
    required = plan_output(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert required.grammar is not None and "TEXT" not in required.grammar.source
    assert '"\\n" call' not in required.grammar.source  # one call only
    assert f"~0..{MAX_PARALLEL_TOOL_CALLS - 1}" in plan.grammar.source  # a bounded number of calls
    none = plan_output(chat(tools=[WEATHER], tool_choice="none"))
    assert none.grammar is None and not none.tools and not none.parse_tool_calls


def test_default_format_renders_tools_calls_and_results() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
        ],
        tools=[WEATHER],
    )
    messages, template_tools = conversation(req.messages, plan_output(req).tools, native=False)
    assert template_tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18C, sunny\n</tool_response>"}
    native, tools = conversation(req.messages, plan_output(req).tools, native=True)
    assert tools is not None and tools[0]["function"]["name"] == "get_weather"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3]["role"] == "tool" and native[3]["tool_call_id"] == "c1"


def test_forced_calls_close_before_max_tokens_with_arguments_that_validate(tiny_model_dir: Path) -> None:
    """`required` is JSON and fixed text only, so near max_tokens it is steered to close: a
    random-weight model (which ends nothing on its own) still ends every output with whole calls
    whose arguments validate, even where its strings alone would overrun the budget."""
    plan = plan_output(chat(tools=[WEATHER], tool_choice="required"))
    assert plan.grammar is not None and plan.grammar.json_only
    assert not plan_output(chat(tools=[WEATHER])).grammar.json_only  # auto: free text may come first
    engine = tiny_engine(tiny_model_dir, max_num_seqs=8)
    requests = [
        GenerationRequest(
            f"r{i}", [1, 2, 3], SamplingParams(max_tokens=96, temperature=1.0, seed=i, grammar=plan.grammar)
        )
        for i in range(8)
    ]
    outs = run_all(engine, requests)
    for i in range(8):
        out = outs[(f"r{i}", 0)]
        assert out[-1].finish_reason is FinishReason.STOP, text_of(out)
        content, calls = parse_message(text_of(out))
        assert content is None and calls
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
            assert set(arguments) <= {"city"}  # no junk keys: the schema declares only this one


def test_tools_beside_a_json_format_answer_in_the_format_or_call(tiny_model_dir: Path) -> None:
    """`auto` with a JSON response_format: the output is calls or an answer in the schema, and
    both are JSON and fixed text, so even a random-weight model closes before max_tokens."""
    schema = {
        "type": "object",
        "properties": {"summary": {"type": "string"}},
        "required": ["summary"],
        "additionalProperties": False,
    }
    plan = plan_output(
        chat(
            tools=[WEATHER],
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        )
    )
    assert plan.grammar is not None and plan.grammar.json_only and "TEXT" not in plan.grammar.source
    engine = tiny_engine(tiny_model_dir, max_num_seqs=8)
    requests = [
        GenerationRequest(
            f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, temperature=1.0, seed=i, grammar=plan.grammar)
        )
        for i in range(8)
    ]
    outs = run_all(engine, requests)
    for i in range(8):
        out = outs[(f"r{i}", 0)]
        assert out[-1].finish_reason is FinishReason.STOP, text_of(out)
        content, calls = parse_message(text_of(out))
        if not calls:
            jsonschema.validate(json.loads(content or ""), schema)


def test_declared_arguments_close_every_object_that_does_not_say() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "opts": {"type": "object", "properties": {"unit": {"type": "string"}}},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            "list": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        },
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["opts"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["additionalProperties"] == {"type": "string"}  # it says
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    tool = {**WEATHER, "function": {**WEATHER["function"], "parameters": schema}}
    forced = plan_output(chat(tools=[tool], tool_choice="required"))
    open_ = plan_output(chat(tools=[tool], tool_choice="required"), closed_arguments=False)
    assert forced.grammar is not None and open_.grammar is not None
    assert forced.grammar.source.count('"additionalProperties": false') == 4  # 3 closed + the call's own
    assert open_.grammar.source.count('"additionalProperties": false') == 1
