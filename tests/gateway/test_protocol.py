"""Request validation at the edge: every bad field is a 400 that names it; conversions to SamplingParams."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import APIError
from gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)

_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def bad_chat(body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(body)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ([1, 2], None, "JSON object"),
        ({"messages": MSG}, "model", "Missing required parameter"),
        ({"model": "m"}, "messages", "Missing required parameter"),
        (chat(messages=[]), "messages", "at least one message"),
        (chat(messages="hi"), "messages", "should be an array"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "'system'"),
        (
            chat(messages=[{"role": "tool", "content": "x"}]),
            "messages[0].tool_call_id",
            "needs 'tool_call_id'",
        ),
        (chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role", "use 'tool'"),
        (
            chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "call_1"}]),
            "messages[0].tool_call_id",
            "answers no tool call",
        ),
        (chat(messages=[{"role": "assistant", "content": None}]), "messages[0].content", "needs content"),
        (chat(messages=[{"role": "user"}]), "messages[0].content", "needs content"),
        (chat(messages=[{"role": "user", "content": None}]), "messages[0].content", "needs content"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "string or a list"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content",
            "'image_url'",
        ),
        (
            chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]),
            "messages[0].mood",
            "Unrecognized",
        ),
        (
            chat(messages=[{"role": "assistant", "content": "x", "tool_calls": [{}]}]),
            "messages[0].tool_calls[0].id",
            "Missing",
        ),
        (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (chat(max_tokens="5"), "max_tokens", "valid integer"),
        (chat(max_tokens=5.5), "max_tokens", "valid integer"),
        (chat(n=True), "n", "valid integer"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
        (chat(max_tokens=5, max_completion_tokens=6), "max_completion_tokens", "aliases"),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(n=129), "n", "less than or equal to 128"),
        (chat(temperature=2.5), "temperature", "less than or equal to 2"),
        (chat(temperature=True), "temperature", "valid number"),
        (chat(top_p=0), "top_p", "greater than 0"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(stop=[""]), "stop", "non-empty"),
        (chat(stop=5), "stop", "string or a list"),
        (chat(seed=2**64), "seed", "less than or equal"),
        (chat(stream="yes"), "stream", "valid boolean"),
        (chat(stream_options={"include_usage": True}), "stream_options", "only allowed when 'stream'"),
        (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage", "boolean"),
        (chat(stream=True, stream_options={"continuous": True}), "stream_options.continuous", "Unrecognized"),
        (chat(logprobs=1), "logprobs", "valid boolean"),
        (chat(top_logprobs=2), "top_logprobs", "requires 'logprobs'"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        (chat(presence_penalty=-3), "presence_penalty", "greater than or equal to -2"),
        (chat(frequency_penalty=2.5), "frequency_penalty", "less than or equal to 2"),
        (chat(logit_bias={"abc": 1}), "logit_bias", "not a token id"),
        (chat(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
        (chat(logit_bias=[1]), "logit_bias", "object"),
        (chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "at most 300"),
        (chat(stream=True, stream_options=5), "stream_options", "should be a JSON object"),
        (chat(top_k=-2), "top_k", "greater than or equal to -1"),
        (chat(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
        (chat(ignore_eos="no"), "ignore_eos", "boolean"),
        (chat(user=5), "user", "valid string"),
        (chat(tools=[{"type": "function"}]), "tools[0].function", "Missing"),
        (
            chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
            "tools[0].function.name",
            "pattern",
        ),
        (chat(tools=[{"type": "retrieval"}]), "tools[0].type", "'function'"),
        (chat(tools=[_TOOL, _TOOL]), "tools[1].function.name", "Duplicate"),
        (chat(tool_choice="auto"), "tool_choice", "only allowed when 'tools'"),
        (chat(tools=[_TOOL], tool_choice="sometimes"), "tool_choice", "'required'"),
        (chat(tools=[_TOOL], tool_choice={"type": "function"}), "tool_choice", "'required'"),
        (
            chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
            "tool_choice",
            "not in",
        ),
        (chat(functions=[{}]), "functions", "not supported"),
        (chat(audio={"voice": "x"}), "audio", "not supported"),
        (chat(modalities=["text", "audio"]), "modalities", "not supported"),
        (chat(response_format={"type": "xml"}), "response_format", "'text', 'json_object', 'json_schema'"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema.json_schema", "Missing"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}),
            "response_format.json_schema.json_schema.schema",
            "JSON object",
        ),
        (chat(store=True), "store", "not supported"),
        (chat(best_of=2), "best_of", "Unrecognized"),
        (chat(frobnicate=1), "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ],
)
def test_bad_chat_field_is_400_naming_the_field(body: Any, param: str | None, text: str) -> None:
    error = bad_chat(body)
    assert error.param == param
    assert text in error.message


def test_explicit_nulls_mean_defaults() -> None:
    optional = {name for name, f in ChatCompletionRequest.model_fields.items() if not f.is_required()}
    req = parse_chat_request(chat(**dict.fromkeys(optional)))
    assert sampling_params(req, num_prompt_tokens=1, max_model_len=10, vocab_size=5).max_tokens == 9
    optional = {name for name, f in CompletionRequest.model_fields.items() if not f.is_required()}
    req = parse_completion_request(completion(**dict.fromkeys(optional)))
    assert sampling_params(req, num_prompt_tokens=1, max_model_len=100, vocab_size=5).max_tokens == 16


def test_integral_floats_are_integers() -> None:
    req = parse_chat_request(chat(max_tokens=5.0, n=2.0, seed=-3.0))
    assert (req.max_tokens, req.n, req.seed) == (5, 2, -3)
    assert parse_completion_request(completion(prompt=[1.0, 2])).prompt == ((1, 2),)


def test_valid_chat_request_normalizes_unions() -> None:
    req = parse_chat_request(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "name": "bot", "refusal": None, "tool_calls": []},
            ],
            stop="END",
            logit_bias={"12": -100, "7": 2.5},
            tools=None,
            store=False,
            response_format={"type": "text"},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert isinstance(req, ChatCompletionRequest)
    assert [m.content for m in req.messages] == ["be brief", "ab", "ok"]
    assert req.stop == ("END",)
    assert req.logit_bias == {12: -100.0, 7: 2.5}
    assert req.include_usage


def test_sampling_defaults_and_context_budget() -> None:
    req = parse_chat_request(chat())
    p = sampling_params(req, num_prompt_tokens=10, max_model_len=100, vocab_size=50)
    assert (p.temperature, p.top_p, p.n, p.max_tokens) == (1.0, 1.0, 1, 90)  # default: the context left

    req = parse_chat_request(
        chat(
            max_completion_tokens=5,
            temperature=0,
            n=3,
            seed=7,
            stop=["x", "y"],
            top_k=4,
            min_tokens=2,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            logit_bias={"3": 1},
        )
    )
    p = sampling_params(req, num_prompt_tokens=10, max_model_len=100, vocab_size=50)
    assert (p.max_tokens, p.temperature, p.n, p.seed, p.stop, p.top_k, p.min_tokens) == (
        5,
        0.0,
        3,
        7,
        ("x", "y"),
        4,
        2,
    )
    assert p.ignore_eos and p.logprobs and p.top_logprobs == 3
    assert p.presence_penalty == 0.5 and p.logit_bias == {3: 1.0}


def test_context_length_error_gives_both_numbers() -> None:
    req = parse_chat_request(chat(max_tokens=50))
    with pytest.raises(APIError) as info:
        sampling_params(req, num_prompt_tokens=60, max_model_len=100, vocab_size=50)
    error = info.value.body()["error"]
    assert info.value.status == 400
    assert error["code"] == "context_length_exceeded"
    assert "100" in error["message"] and "110" in error["message"]
    assert "60 in the prompt" in error["message"] and "50 in the completion" in error["message"]

    with pytest.raises(APIError) as info:  # no max_tokens, and the prompt fills the context
        sampling_params(parse_chat_request(chat()), num_prompt_tokens=100, max_model_len=100, vocab_size=50)
    assert "100 tokens" in info.value.message


def test_min_tokens_above_max_tokens_and_bias_outside_vocab() -> None:
    with pytest.raises(APIError, match="min_tokens"):
        sampling_params(
            parse_chat_request(chat(max_tokens=2, min_tokens=3)),
            num_prompt_tokens=1,
            max_model_len=100,
            vocab_size=50,
        )
    with pytest.raises(APIError, match="outside the vocabulary"):
        sampling_params(
            parse_chat_request(chat(logit_bias={"50": 1})),
            num_prompt_tokens=1,
            max_model_len=100,
            vocab_size=50,
        )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1, 2], [3]], ((1, 2), (3,))),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: tuple[Any, ...]) -> None:
    req = parse_completion_request(completion(prompt=prompt))
    assert isinstance(req, CompletionRequest)
    assert req.prompt == expected


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        (completion(prompt=[]), "prompt", "must be a string"),
        (completion(prompt=[["a"]]), "prompt", "must be a string"),
        (completion(prompt=[[]]), "prompt", "must be a string"),
        (completion(prompt=[1, "a"]), "prompt", "must be a string"),
        (completion(prompt=[True]), "prompt", "must be a string"),
        (completion(suffix="x"), "suffix", "not supported"),
        (completion(logprobs=6), "logprobs", "less than or equal to 5"),
        (completion(logprobs=True), "logprobs", "valid integer"),
        (completion(best_of=3), "best_of", "other than 'n'"),
        (completion(echo=True, logprobs=1), "echo", "not supported"),
        (completion(prompt=["a"] * 5, n=30), "n", "at most 128"),
        (completion(messages=MSG), "messages", "Unrecognized"),
    ],
)
def test_bad_completion_field(body: Any, param: str, text: str) -> None:
    with pytest.raises(APIError) as info:
        parse_completion_request(body)
    assert info.value.param == param
    assert text in info.value.message


def test_completion_defaults() -> None:
    req = parse_completion_request(completion(logprobs=0, best_of=1))
    p = sampling_params(req, num_prompt_tokens=3, max_model_len=100, vocab_size=50)
    assert p.max_tokens == 16  # OpenAI's legacy default
    assert p.logprobs and p.top_logprobs == 0


def test_a_message_the_sdk_assembled_can_be_sent_back() -> None:
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    call["function"]["parsed_arguments"] = {}  # type: ignore[index]
    req = parse_chat_request(
        chat(
            messages=[
                *MSG,
                {"role": "assistant", "content": None, "tool_calls": [call], "parsed": None, "refusal": None},
                {"role": "tool", "content": "1", "tool_call_id": "c1"},
            ]
        )
    )
    assert req.messages[1].tool_calls is not None and req.messages[1].tool_calls[0].function.arguments == "{}"
