"""The Messages API at the edge, on the fake engine (no model): parsing and its 400s in Anthropic's
words, the error map and dialect (whole errors, an error mid-stream, the drain, routes the
protocol owns), the key in `x-api-key`, the chat form (the billing line, tools, the history), the
window rule, the content blocks of a message, the model list and aliases."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.anthropic import chat_form, output
from gateway.anthropic.errors import ANTHROPIC, ERROR_MAP, MESSAGE_STOP
from gateway.anthropic.request import parse_count_tokens_request, parse_messages_request
from gateway.errors import APIError, ErrorKind
from gateway.events import UsageEvent
from gateway.openai.formats import mistral_call_id
from gateway.openai.parsers import JsonCallsParser, ThinkSplitter
from gateway.openai.tools import ToolCallParser
from gateway.settings import ModelAlias, Settings, load_model_aliases
from tests.gateway.conftest import AppFactory, client_for, stream_through
from tests.gateway.fakes import FakeDecision, FakeEngine, FakeTenancy

MODEL = "fake-model"
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


def msg(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of each frame of an Anthropic stream."""
    out = []
    for frame in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


# -- parsing: every bad input is a 400 in Anthropic's words -----------------------------------

BAD: list[tuple[str, Any, str]] = [
    ("not an object", [1], "The request body must be a JSON object."),
    (
        "no max_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "max_tokens: Field required",
    ),
    ("unknown field", msg(colour="red"), "colour: Extra inputs are not permitted"),
    ("no messages", msg(messages=[]), "messages: List should have at least 1 item after validation, not 0"),
    ("max_tokens 0", msg(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
    ("temperature over 1", msg(temperature=1.5), "temperature: Input should be less than or equal to 1"),
    ("a number as content", msg(messages=[{"role": "user", "content": 5}]), "must be a string or a list"),
    (
        "a text block without text",
        msg(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages.0.content.0.text: Field required",
    ),
    (
        "an image",
        msg(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        "block 0 is an `image` block: this server's models read text only",
    ),
    (
        "a document in a tool result",
        msg(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "document"}]}
                    ],
                }
            ]
        ),
        "`document` block",
    ),
    (
        "a server tool",
        msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools: tool 0 is Anthropic's server tool `web_search_20250305`",
    ),
    (
        "a tool without input_schema",
        msg(tools=[{"name": "f"}]),
        "tools.0.input_schema: Field required",
    ),
    (
        "a bad tool name",
        msg(tools=[{"name": "a b", "input_schema": {}}]),
        "tools.0.name: String should match",
    ),
    (
        "twice the same tool",
        msg(tools=[{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]),
        "tools.1.name: tool names must be unique",
    ),
    (
        "tool_choice without tools",
        msg(tool_choice={"type": "any"}),
        "tool_choice: may be given only with tools",
    ),
    (
        "tool_choice of another tool",
        msg(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool", "name": "g"}),
        "tool_choice.name: `g` is not one of the tools",
    ),
    ("an unknown tool_choice", msg(tool_choice={"type": "sometimes"}), "tool_choice: Input tag 'sometimes'"),
    (
        "a user's tool_use",
        msg(
            messages=[
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        ),
        "messages.0.content.0: a `tool_use` block belongs to an assistant message",
    ),
    (
        "a prefill",
        msg(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]),
        "a prefill is not supported",
    ),
    ("thinking of another type", msg(thinking={"type": "deep"}), "thinking.type: Input should be"),
    ("a container", msg(container="c-1"), "container: not supported by this server"),
    ("a bad role", msg(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role: Input should be"),
]


@pytest.mark.parametrize("case", range(len(BAD)), ids=[c[0] for c in BAD])
def test_bad_requests_are_400s_in_anthropics_words(case: int) -> None:
    _, body, expected = BAD[case]
    with pytest.raises(APIError) as info:
        parse_messages_request(body)
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert expected in info.value.message, info.value.message


def test_what_claude_code_sends_is_accepted_and_the_ignored_fields_named() -> None:
    req = parse_messages_request(
        msg(
            system=[
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"},
                {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
            ],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"}],
                },
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "text",
                            "text": "# Environment",
                            "cache_control": {"type": "ephemeral", "ttl": "1h"},
                        }
                    ],
                },
            ],
            tools=[
                {"name": "Bash", "input_schema": {"type": "object"}},
                {"name": "Later", "input_schema": {}, "defer_loading": True},
            ],
            thinking={"type": "adaptive", "display": "omitted"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            output_config={"effort": "medium"},
            metadata={"user_id": '{"session_id":"s"}'},
            stream=True,
            cache_control={"type": "ephemeral"},
        )
    )
    assert req.ignored == ["thinking", "context_management", "output_config.effort"]
    assert req.user == '{"session_id":"s"}'
    count = parse_count_tokens_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert count.stream is False and count.ignored == []
    with pytest.raises(APIError, match="max_tokens: Extra inputs"):
        parse_count_tokens_request({**msg()})


# -- the chat form ----------------------------------------------------------------------------


def test_the_chat_form_leaves_out_the_billing_line_and_thinking_and_keeps_the_rest() -> None:
    req = parse_messages_request(
        msg(
            system=[
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cch=00000;"},
                {"type": "text", "text": "Be brief."},
                {"type": "text", "text": "Be exact."},
            ],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": ""},
                        {"type": "text", "text": "Calling."},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                        {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "one"}],
                        },
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "two", "is_error": True},
                        {"type": "text", "text": "go on"},
                    ],
                },
                {"role": "system", "content": "per-turn context"},
                {"role": "user", "content": "last"},
            ],
            tools=[
                {"name": "f", "description": "F.", "input_schema": {"type": "object"}, "strict": True},
                {"name": "g" * 100, "input_schema": {}},
                {"name": "later", "input_schema": {}, "defer_loading": True},
            ],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["1", "2", "3", "4", "5", "6"],
            temperature=0.5,
            top_k=5,
            metadata={"user_id": "u"},
        )
    )
    chat = chat_form.to_chat(req)
    rendered = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert rendered == [
        {"role": "system", "content": "Be brief.\n\nBe exact."},
        {"role": "user", "content": "a\n\nb"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "one", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "two", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "go on"},
        {"role": "system", "content": "per-turn context"},
        {"role": "user", "content": "last"},
    ]
    assert [t.function.name for t in chat.tools or ()] == ["f", "g" * 100]  # not the deferred one
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ("1", "2", "3", "4", "5", "6")  # Anthropic's, not chat's 4
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.user) == (5, 0.5, 5, "u")
    # The billing line changes nothing of what the model reads.
    other = req.model_copy(
        update={
            "system": [
                req.system[0].model_copy(update={"text": "x-anthropic-billing-header: cch=99;"}),
                *req.system[1:],
            ]
        }
    )
    assert chat_form.to_chat(other).messages == chat.messages


def test_a_max_tokens_over_the_room_is_cut_to_it_and_a_prompt_without_room_is_too_long() -> None:
    window = chat_form.Window(32000)
    assert window.fit(100, 8192) == 8092 and window.headers == {"x-batchgate-clamped-max-tokens": "8092"}
    assert chat_form.Window(50).fit(100, 8192) == 50 and chat_form.Window(50).headers == {}
    with pytest.raises(APIError) as info:
        chat_form.Window(5).fit(8192, 8192)
    assert info.value.message == "prompt is too long: 8192 tokens > 8191 maximum"
    assert ANTHROPIC.error_response(info.value).status_code == 400


# -- the message's content blocks ---------------------------------------------------------------


def test_blocks_stream_and_assemble_alike() -> None:
    text = (
        'Let me look. <tool_call>{"name":"f","arguments":{"x":"a}b"}}</tool_call>\n'
        '<tool_call>{"name":"g","arguments":{}}</tool_call>'
    )
    whole = output.Blocks(ToolCallParser())
    whole.feed(text, final=True)
    whole.close()
    streamed = output.Blocks(ToolCallParser())
    frames: list[bytes] = []
    for i in range(0, len(text), 3):
        frames += streamed.feed(text[i : i + 3], final=i + 3 >= len(text))
    frames += streamed.close()
    assert whole.content[0] == {"type": "text", "text": "Let me look. "}
    assert [(b["type"], b.get("name"), b.get("input")) for b in whole.content[1:]] == [
        ("tool_use", "f", {"x": "a}b"}),
        ("tool_use", "g", {}),
    ]
    assert all(b["id"].startswith("toolu_") for b in whole.content[1:])
    ids = [b.get("id") for b in streamed.content]
    assert [{**b, "id": None} for b in streamed.content] == [
        {**b, "id": None} for b in whole.content
    ] and len(ids) == 3
    kinds = [k for k, _ in events_of(b"".join(frames).decode())]
    assert kinds[0] == "content_block_start" and kinds.count("content_block_stop") == 3
    partial = "".join(
        d["delta"]["partial_json"]
        for k, d in events_of(b"".join(frames).decode())
        if d.get("delta", {}).get("type") == "input_json_delta" and d["index"] == 1
    )
    assert json.loads(partial) == {"x": "a}b"}
    # Whitespace before a call is not a text block; whitespace alone is one.
    calls = output.Blocks(ToolCallParser())
    calls.feed('\n <tool_call>{"name":"f","arguments":{}}</tool_call>', final=True)
    calls.close()
    assert [b["type"] for b in calls.content] == ["tool_use"]
    blank = output.Blocks(ToolCallParser())
    blank.feed("\n", final=True)
    blank.close()
    assert blank.content == [{"type": "text", "text": "\n"}]


def test_blocks_read_the_model_family_s_calls_and_leave_out_its_reasoning() -> None:
    """A family's own reader (Mistral's `[TOOL_CALLS]`, under Qwen3-style thinking): its calls
    are tool_use blocks, its reasoning is not shown."""
    mistral = JsonCallsParser(("[TOOL_CALLS]",), array=True, new_id=mistral_call_id)
    blocks = output.Blocks(ThinkSplitter(mistral))
    blocks.feed('<think>Paris, then.</think>\n[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', final=True)
    blocks.close()
    read = [(b["type"], b.get("name"), b.get("input")) for b in blocks.content]
    assert read == [("tool_use", "f", {"x": 1})]
    assert blocks.num_calls == 1
    plain = output.Blocks(ThinkSplitter(ToolCallParser()))
    plain.feed("<think>hmm</think>\nHello.", final=True)
    plain.close()
    assert plain.content == [{"type": "text", "text": "Hello."}]


# -- over HTTP ------------------------------------------------------------------------------------


async def test_a_message_whole_and_streamed(make_app: AppFactory) -> None:
    async with client_for(make_app()) as c:
        r = await c.post("/v1/messages?beta=true", json=msg(max_tokens=100), headers=ANTHROPIC_HEADERS)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("msg_") and r.headers["x-request-id"] == body["id"]
        assert body["content"] == [{"type": "text", "text": "Hello 0!"}]
        assert (body["type"], body["role"], body["model"], body["stop_reason"], body["stop_sequence"]) == (
            "message",
            "assistant",
            MODEL,
            "end_turn",
            None,
        )
        prompt = body["usage"]["input_tokens"]
        assert body["usage"] == {
            "input_tokens": prompt,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 8,
        }
        r = await c.post("/v1/messages", json=msg(max_tokens=3, stream=True))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith(MESSAGE_STOP.decode())
        events = events_of(r.text)
        kinds = [k for k, _ in events]
        assert kinds == [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert all(data["type"] == kind for kind, data in events)
        assert events[0][1]["message"]["usage"]["input_tokens"] == prompt
        assert events[-2][1] == {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {
                "input_tokens": prompt,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 3,
            },
        }
        r = await c.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": msg()["messages"]})
        assert r.json() == {"input_tokens": prompt}


async def test_clamping_and_ignored_fields_are_said_in_headers(make_app: AppFactory) -> None:
    async with client_for(make_app()) as c:
        r = await c.post(
            "/v1/messages", json=msg(max_tokens=32000, thinking={"type": "enabled", "budget_tokens": 2000})
        )
    assert r.status_code == 200
    assert int(r.headers["x-batchgate-clamped-max-tokens"]) == 256 - r.json()["usage"]["input_tokens"]
    assert r.headers["x-batchgate-ignored"] == "thinking"


async def test_errors_in_anthropics_shape_on_every_path(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    async with client_for(make_app()) as c:
        r = await c.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/v1/messages", json=msg(model="claude-nope"))
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/v1/messages/batches", json={})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await c.post("/v1/messages", json=msg(messages=[{"role": "user", "content": "x" * 300}]))
        assert r.json()["error"]["message"].startswith("prompt is too long: ")
        # OpenAI's routes keep OpenAI's shape.
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "claude-nope", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # An engine failure mid-stream is an `error` event, the stream's last.
        fake_engine.fail_after = 2
        r = await c.post("/v1/messages", json=msg(max_tokens=20, stream=True))
        events = events_of(r.text)
        assert events[-1] == (
            "error",
            {"type": "error", "error": {"type": "api_error", "message": "generation failed: boom"}},
        )
        assert "message_stop" not in [k for k, _ in events]
        # Shed before it started (the engine's queue deadline): 529 overloaded_error, retry-after.
        from engine.types import EngineOverloadedError

        fake_engine.fail_after = None
        fake_engine.submit_error = EngineOverloadedError("busy", retry_after_s=3.0)
        r = await c.post("/v1/messages", json=msg())
        assert (r.status_code, r.json()["error"]["type"], r.headers["retry-after"]) == (
            529,
            "overloaded_error",
            "3",
        )


async def test_a_draining_server_refuses_in_anthropics_shape(make_app: AppFactory) -> None:
    app = make_app()
    app.state.gateway.drain.begin()
    async with client_for(app) as c:
        r = await c.post("/v1/messages", json=msg())
        openai = await c.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
    assert (
        r.status_code == 529
        and r.json()["error"]["type"] == "overloaded_error"
        and r.headers["retry-after"] == "1"
    )
    assert openai.status_code == 503 and openai.json()["error"]["code"] == "server_overloaded"


def test_every_error_kind_has_an_anthropic_status_and_type() -> None:
    assert set(ERROR_MAP) == set(ErrorKind)
    statuses = {kind: status for kind, (status, _) in ERROR_MAP.items()}
    assert statuses[ErrorKind.OVERLOADED] == 529 and statuses[ErrorKind.INSUFFICIENT_QUOTA] == 429
    error = APIError(
        ErrorKind.RATE_LIMITED, "slow down", retry_after_s=2.5, headers={"x-ratelimit-limit-requests": "1"}
    )
    response = ANTHROPIC.error_response(error)
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert json.loads(bytes(response.body)) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert ANTHROPIC.is_last(ANTHROPIC.error_event(error)) and ANTHROPIC.is_last(MESSAGE_STOP)


async def test_the_key_comes_in_x_api_key_or_as_a_bearer_token(make_app: AppFactory) -> None:
    tenancy = FakeTenancy()
    async with client_for(make_app(tenancy=tenancy)) as c:
        none = await c.post("/v1/messages", json=msg())
        wrong = await c.post("/v1/messages", json=msg(), headers={"x-api-key": "sk-bad"})
        by_header = await c.post("/v1/messages", json=msg(), headers={"x-api-key": "sk-good"})
        bearer = await c.post("/v1/messages", json=msg(), headers={"authorization": "Bearer sk-good"})
        models = await c.get("/v1/models", headers={"x-api-key": "sk-good", **ANTHROPIC_HEADERS})
        # OpenAI's routes still read the Authorization header only.
        chat = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "sk-good"},
        )
        tenancy.refuse = FakeDecision(admitted=False, reason="tokens", retry_after_s=4)
        limited = await c.post("/v1/messages", json=msg(), headers={"x-api-key": "sk-good"})
    for r in (none, wrong):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert by_header.status_code == bearer.status_code == models.status_code == 200
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
    assert limited.status_code == 429 and limited.headers["retry-after"] == "4"
    assert limited.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Rate limit reached (tokens)."},
    }
    # count_tokens is admitted like the rest, and charged nothing.
    assert [p for _, p, _ in tenancy.settled] == [by_header.json()["usage"]["input_tokens"]] * 2


async def test_count_tokens_is_refunded_whole(make_app: AppFactory) -> None:
    tenancy = FakeTenancy()
    async with client_for(make_app(tenancy=tenancy)) as c:
        r = await c.post(
            "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": msg()["messages"]},
            headers={"x-api-key": "sk-good"},
        )
    assert r.status_code == 200 and tenancy.admitted[0][1] == r.json()["input_tokens"]
    assert tenancy.settled == [(tenancy.admitted[0][3], 0, 0)]


# -- models: the list in Anthropic's shape, aliases ---------------------------------------------


async def test_the_model_list_in_anthropics_shape_and_aliases(make_app: AppFactory, tmp_path: Path) -> None:
    models = tmp_path / "models.toml"
    models.write_text(
        '[[aliases]]\nname = "claude-sonnet-4-5"\nmodel = "fake-model"\n\n'
        '[[aliases]]\nname = "claude-*"\nmodel = "fake-model"\n'
    )
    async with client_for(make_app(models_file=str(models))) as c:
        listed = (await c.get("/v1/models", headers=ANTHROPIC_HEADERS)).json()
        openai = (await c.get("/v1/models")).json()
        one = (await c.get("/v1/models/claude-opus-5-5", headers=ANTHROPIC_HEADERS)).json()
        r = await c.post("/v1/messages", json=msg(model="claude-opus-5-5"))
        chat = await c.post(
            "/v1/chat/completions",
            json={"model": "claude-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    assert [m["id"] for m in listed["data"]] == [MODEL, "claude-sonnet-4-5"]
    assert (
        listed["data"][0]["type"] == "model" and listed["has_more"] is False and listed["first_id"] == MODEL
    )
    assert [m["id"] for m in openai["data"]] == [MODEL] and openai["object"] == "list"
    assert one["id"] == "claude-opus-5-5" and one["type"] == "model"
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert chat.status_code == 200 and chat.json()["model"] == MODEL


async def test_an_alias_of_a_model_not_served_is_a_404_naming_both(
    make_app: AppFactory, tmp_path: Path
) -> None:
    models = tmp_path / "models.toml"
    models.write_text('[[aliases]]\nname = "*"\nmodel = "gone"\n')
    async with client_for(make_app(models_file=str(models))) as c:
        r = await c.post("/v1/messages", json=msg(model="claude-x"))
        served = await c.post("/v1/messages", json=msg())
    assert (
        r.status_code == 404
        and r.json()["error"]["message"] == "The model `claude-x` is an alias of `gone`, which is not served."
    )
    assert served.status_code == 200  # a served name is never an alias


def test_the_models_file_aliases(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[[aliases]]\nname = "claude-*"\nmodel = "m"\n')
    (alias,) = load_model_aliases(str(path))
    assert (
        alias == ModelAlias("claude-*", "m")
        and alias.matches("claude-opus-5-5")
        and not alias.matches("gpt-4")
    )
    assert Settings(models_file=str(path)).served_models() == []
    path.write_text('[[aliases]]\nname = "claude-*"\n')
    with pytest.raises(ValueError, match="alias 1: needs a model"):
        load_model_aliases(str(path))
    path.write_text('[[aliases]]\nname = "a"\nmodel = "m"\ntarget = "x"\n')
    with pytest.raises(ValueError, match="unknown field"):
        load_model_aliases(str(path))


def test_a_usage_event_names_its_user_only_where_there_is_one() -> None:
    event = UsageEvent("r", "t", "k", "m", 1, 0, 1, 0, "served", 0.0, 1.0)
    assert "user" not in event.fields()
    assert UsageEvent("r", "t", "k", "m", 1, 0, 1, 0, "served", 0.0, 1.0, user="u").fields()["user"] == "u"


async def test_a_client_gone_mid_stream_releases_the_request(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    tenancy = FakeTenancy()
    fake_engine.gate = asyncio.Event()
    async with client_for(make_app(tenancy=tenancy)) as c:
        task = asyncio.ensure_future(
            c.post("/v1/messages", json=msg(stream=True), headers={"x-api-key": "sk-good"})
        )
        while not fake_engine.submitted:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake_engine.gate.set()
        for _ in range(200):
            if tenancy.settled:
                break
            await asyncio.sleep(0.01)
    assert len(tenancy.settled) == 1 and fake_engine.num_active == 0
    _ = httpx  # the client above is httpx's


# -- the OpenAPI document describes what is sent ---------------------------------------------------


def _validator(name: str) -> Any:
    import jsonschema

    from gateway.openapi.document import build_openapi

    doc = build_openapi(MODEL)
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    )


async def test_what_is_sent_matches_the_document(make_app: AppFactory, fake_engine: FakeEngine) -> None:
    async with client_for(make_app()) as c:
        whole = await c.post("/v1/messages", json=msg(system="Be brief."))
        stream = await c.post("/v1/messages", json=msg(stream=True))
        count = await c.post(
            "/v1/messages/count_tokens", json={"model": MODEL, "messages": msg()["messages"]}
        )
        error = await c.post("/v1/messages", json=msg(model="nope"))
        models = await c.get("/v1/models", headers=ANTHROPIC_HEADERS)
        fake_engine.fail_after = 1
        failed = await c.post("/v1/messages", json=msg(stream=True))
    _validator("Message").validate(whole.json())
    _validator("MessageTokensCount").validate(count.json())
    _validator("ErrorResponse").validate(error.json())
    _validator("ModelInfoPage").validate(models.json())
    calls = output.Blocks(ToolCallParser())
    frames = (
        calls.feed('<tool_call>{"name":"f","arguments":{"a":[1]}}</tool_call>', final=True) + calls.close()
    )
    events = events_of(stream.text + failed.text + b"".join(frames).decode())
    assert {kind for kind, _ in events} >= {"message_start", "content_block_delta", "message_delta", "error"}
    for _, data in events:
        _validator("MessageStreamEvent").validate(data)
    _validator("Message").validate({**whole.json(), "content": calls.content, "stop_reason": "tool_use"})
    assert not _validator("Message").is_valid({**whole.json(), "stop_reason": "finished"})


async def test_a_stream_cut_by_the_drain_deadline_ends_with_an_error_event(
    make_app: AppFactory, fake_engine: FakeEngine
) -> None:
    app = make_app(keep_alive_s=0.05)
    fake_engine.gate = asyncio.Event()  # the answer never comes
    chunks, handler = await stream_through(app, "/v1/messages", msg(stream=True))
    first = await asyncio.wait_for(chunks.get(), 10)
    assert first == b": keep-alive\n\n"  # the 200 stream has started
    app.state.gateway.drain.stop_all()
    await asyncio.wait_for(handler, 10)
    text = (first + b"".join(chunks.get_nowait() for _ in range(chunks.qsize()))).decode()
    (event,) = events_of(text)
    assert event == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": event[1]["error"]["message"]}},
    )
    assert "[DONE]" not in text and fake_engine.aborted == [fake_engine.submitted[0].request_id]


async def test_the_trace_has_the_end_user_and_the_generation(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_enabled", True)
    monkeypatch.setattr("opentelemetry.trace.get_tracer", lambda name, *a, **k: provider.get_tracer(name))
    async with client_for(make_app()) as c:
        r = await c.post("/v1/messages", json=msg(metadata={"user_id": "user-42"}, temperature=0.5))
    (span,) = [s for s in exporter.get_finished_spans() if s.name == f"chat {MODEL}"]
    attributes = dict(span.attributes or {})
    assert attributes["user.id"] == "user-42" and attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.response.id"] == r.json()["id"]
