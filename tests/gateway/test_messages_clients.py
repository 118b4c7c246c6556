"""Anthropic's Python SDK (`anthropic`), unchanged but for `base_url`, against a real server: the
tiny random-weight model on the real engine, tenants with keys (in memory), a models file whose
alias maps Claude's ids to the served model. The model is random, so tool calls are forced (the
grammar makes them valid) and texts are compared between two paths, not read.

Also here: Claude-Code-shaped requests (a billing line first in `system`) and the prefix cache,
and pool mode (a gateway in front of a replica over the same engine) giving the same answers,
with its ledger equal to the answers' usage.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import LiveServer

MODEL = "tiny"
WINDOW = 4096
INTERNAL = "messages-internal-token"
TENANTS = """
[plans.paid]
priority = "paid"
tokens_per_minute = 10000000
requests_per_minute = 100000
max_concurrent_requests = 64
queue_deadline_seconds = 60

[plans.once]
priority = "paid"
tokens_per_minute = 10000000
requests_per_minute = 1
max_concurrent_requests = 64
queue_deadline_seconds = 60

[tenants.acme]
plan = "paid"
keys = ["{acme}"]

[tenants.once]
plan = "once"
keys = ["{once}"]

[tenants.broke]
plan = "paid"
keys = ["{broke}"]
budget_tokens = 10
budget_window = "daily"
"""
MODELS_FILE = f"""
[[aliases]]
name = "claude-*"
model = "{MODEL}"
"""
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
GREEDY = {"temperature": 0}  # the SDK has no sampling parameters: they go in the body


class Servers:
    def __init__(self, local: LiveServer, gateway: LiveServer, events: Path) -> None:
        self.local = local
        self.gateway = gateway
        self.events = events

    def client(self, key: str = "sk-acme", *, via: str = "local", **kwargs: Any) -> anthropic.Anthropic:
        server = self.local if via == "local" else self.gateway
        kwargs.setdefault("max_retries", 0)
        return anthropic.Anthropic(base_url=server.base_url, api_key=key, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The model in process behind tenancy, and a gateway (its own tenancy) in front of a replica
    over the same engine."""
    work = tmp_path_factory.mktemp("messages")
    tenants = work / "tenants.toml"
    tenants.write_text(
        TENANTS.format(acme=hash_key("sk-acme"), once=hash_key("sk-once"), broke=hash_key("sk-broke"))
    )
    models = work / "models.toml"
    models.write_text(MODELS_FILE)
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            served_model_name=MODEL,
            dtype="float32",
            device="cpu",
            max_model_len=WINDOW,
            max_num_seqs=4,
            kv_cache_memory_bytes=64 << 20,
        )
    )
    common = {"keep_alive_s": 1.0, "embedding_model": "none", "models_file": str(models)}
    events = work / "usage.jsonl"
    local_settings = Settings(**common, tenants=str(tenants), usage_events_file=str(events))
    servers: list[LiveServer] = []
    try:
        local = LiveServer(
            create_app(
                local_settings, engine=engine, tenancy=build_tenancy(local_settings), owns_tenancy=True
            )
        )
        servers.append(local)
        replica = LiveServer(
            create_app(
                Settings(keep_alive_s=1.0, embedding_model="none", internal_token=INTERNAL), engine=engine
            )
        )
        servers.append(replica)
        gateway_settings = Settings(
            **common,
            tenants=str(tenants),
            upstreams=(replica.base_url,),
            internal_token=INTERNAL,
            health_interval_s=0.2,
        )
        gateway = LiveServer(
            create_app(gateway_settings, tenancy=build_tenancy(gateway_settings), owns_tenancy=True)
        )
        servers.append(gateway)
        deadline = time.monotonic() + 20
        while httpx.get(gateway.base_url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not see its replica"
            time.sleep(0.05)
        yield Servers(local, gateway, events)
    finally:
        for server in reversed(servers):
            server.stop()
        engine.shutdown()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_create_and_the_stream_helper_assemble_the_same_message(servers: Servers) -> None:
    client = servers.client()
    args: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": user("Hello there"),
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**args)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    with client.messages.stream(**args) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    total = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == total
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_stream_helper_assembles_a_forced_tool_input(servers: Servers) -> None:
    client = servers.client()
    kinds: list[str] = []
    with client.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=user("Weather in Paris?"),
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert "input_json" in kinds and kinds[-1] == "message_stop", kinds
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"


def test_a_forced_tool_then_its_result_round_trip(servers: Servers) -> None:
    client = servers.client()
    first = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=user("Weather in Paris?"),
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and first.stop_reason == "tool_use"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    history = [
        *user("Weather in Paris?"),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 21 C"},
                {"type": "text", "text": "Say it in one word."},
            ],
        },
    ]
    second = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=history,
        tools=[WEATHER],
        extra_body=GREEDY,  # type: ignore[list-item]
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # A result that answers no call is refused, in Anthropic's words.
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}],
                }
            ],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "answers no `tool_use` block" in info.value.message


def test_thinking_blocks_in_the_history_are_accepted_and_not_shown_to_the_model(servers: Servers) -> None:
    client = servers.client()
    plain = [*user("Hi"), {"role": "assistant", "content": "Hello!"}, *user("And now?")]
    thought = [
        *user("Hi"),
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The user greets me.", "signature": ""},
                {"type": "redacted_thinking", "data": "b3BhcXVl"},
                {"type": "text", "text": "Hello!"},
            ],
        },
        *user("And now?"),
    ]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    counted = [
        client.messages.count_tokens(model=MODEL, messages=m, thinking=thinking).input_tokens  # type: ignore[arg-type]
        for m in (plain, thought)
    ]
    assert counted[0] == counted[1]
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=4,
        messages=thought,
        thinking=thinking,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert raw.headers["x-batchgate-ignored"] == "thinking"
    assert raw.parse().stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_equals_the_input_tokens_of_the_same_request(servers: Servers) -> None:
    client = servers.client()
    prompt: dict[str, Any] = {
        "model": MODEL,
        "system": f"You answer briefly. ({time.time_ns()})",  # a prompt no earlier request cached
        "messages": user("What is the capital of France?"),
        "tools": [WEATHER],
    }
    counted = client.messages.count_tokens(**prompt)
    answered = client.messages.create(**prompt, max_tokens=4, extra_body=GREEDY)
    assert answered.usage.cache_read_input_tokens == 0
    assert counted.input_tokens == answered.usage.input_tokens
    # The same prompt again: the cache serves part of it; Anthropic's total is the sum.
    again = client.messages.create(**prompt, max_tokens=4, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens and again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens


def test_errors_come_in_anthropics_shape_and_status(servers: Servers) -> None:
    client = servers.client()
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        servers.client("sk-wrong").messages.create(model=MODEL, max_tokens=4, messages=user("hi"))
    assert bad_key.value.status_code == 401
    assert bad_key.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    with pytest.raises(anthropic.BadRequestError) as no_max_tokens:
        client.post("/v1/messages", body={"model": MODEL, "messages": user("hi")}, cast_to=httpx.Response)
    assert no_max_tokens.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="gpt-4o", max_tokens=4, messages=user("hi"))
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "`gpt-4o` does not exist" in unknown.value.message
    once = servers.client("sk-once")
    once.messages.create(model=MODEL, max_tokens=2, messages=user("hi"))
    with pytest.raises(anthropic.RateLimitError) as limited:
        once.messages.create(model=MODEL, max_tokens=2, messages=user("hi"))
    assert limited.value.status_code == 429 and int(limited.value.response.headers["retry-after"]) >= 1
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    with pytest.raises(anthropic.RateLimitError) as broke:
        servers.client("sk-broke", max_retries=2).messages.create(
            model=MODEL, max_tokens=2, messages=user("hi")
        )
    assert broke.value.response.headers["x-should-retry"] == "false"  # the SDK tried once
    assert "budget" in broke.value.message
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model=MODEL, max_tokens=4, messages=user("word " * WINDOW))
    assert re.fullmatch(
        rf"prompt is too long: \d+ tokens > {WINDOW - 1} maximum", too_long.value.body["error"]["message"]
    )  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as image:
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}])
    assert "read text only" in image.value.message


def test_max_tokens_over_the_window_is_clamped_and_said(servers: Servers) -> None:
    client = servers.client()
    long = user("word " * (WINDOW - 80))  # leaves some 60 tokens of room
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=32000, messages=long, stop_sequences=["a", "e", "i", "o", "u", "y"]
    )
    message = raw.parse()
    room = WINDOW - message.usage.input_tokens - (message.usage.cache_read_input_tokens or 0)
    assert 0 < room < 100 and raw.headers["x-batchgate-clamped-max-tokens"] == str(room)
    assert message.usage.output_tokens <= room
    fits = client.messages.with_raw_response.create(model=MODEL, max_tokens=3, messages=user("Hi"))
    assert "x-batchgate-clamped-max-tokens" not in fits.headers


def test_a_stop_sequence_ends_the_message_and_is_named(servers: Servers) -> None:
    client = servers.client()
    args: dict[str, Any] = {"model": MODEL, "messages": user("Tell me a story"), "extra_body": GREEDY}
    free = client.messages.create(**args, max_tokens=24)
    text = free.content[0].text  # type: ignore[union-attr]
    # Three characters from the second half that are not blank (random weights: any text).
    starts = [i for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip()]
    assert starts, text
    stop = text[starts[0] : starts[0] + 3]
    assert text.index(stop) > 0, text
    stopped = client.messages.create(**args, max_tokens=24, stop_sequences=[stop, "\x00never"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with client.messages.stream(**args, max_tokens=24, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_claudes_model_ids_work_through_the_alias_and_the_model_list(servers: Servers) -> None:
    client = servers.client()
    message = client.messages.create(model="claude-opus-5-5", max_tokens=2, messages=user("hi"))
    assert message.model == MODEL  # the model that answered, as Anthropic names its snapshots
    listed = [m.id for m in client.models.list()]
    assert listed == [MODEL]  # a pattern names no id to list
    assert client.models.retrieve("claude-sonnet-4-5").id == "claude-sonnet-4-5"


def test_the_end_user_is_in_the_usage_event(servers: Servers) -> None:
    client = servers.client()
    message = client.messages.create(
        model=MODEL, max_tokens=2, messages=user("hi"), metadata={"user_id": "user-7f3a"}
    )
    deadline = time.monotonic() + 5
    while True:
        events = [json.loads(line) for line in servers.events.read_text().splitlines()]
        mine = [e for e in events if e["request_id"] == message.id]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert mine and mine[0]["user"] == "user-7f3a" and mine[0]["tenant"] == "acme"
    assert mine[0]["input_tokens"] == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )


# -- Claude Code's requests and the prefix cache ----------------------------------------------


def claude_code_shaped(billing: str) -> dict[str, Any]:
    """A request shaped as Claude Code's first (~1,500 tokens here): the billing line, system
    blocks with cache_control, tools, a user turn of <system-reminder> blocks, thinking,
    context_management, metadata.user_id as a JSON string, output_config; the model's own words
    are not Claude Code's, only the shape."""
    cached = {"type": "ephemeral"}
    rules = " ".join(f"Rule {i}: keep answers short and exact." for i in range(60))
    tools = [
        {
            "name": name,
            "description": f"The {name} tool. " + "It acts on the workspace. " * 10,
            "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        }
        for name in ("Read", "Write", "Edit", "Bash")
    ]
    tools.append({**tools[0], "name": "Deferred", "defer_loading": True})
    return {
        "model": "claude-opus-5-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.328.593; cc_entrypoint=sdk-cli; "
                f"cch={billing};",
            },
            {"type": "text", "text": "You are a coding agent.", "cache_control": cached},
            {"type": "text", "text": rules, "cache_control": cached},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nThe workspace is empty.\n</system-reminder>",
                    },
                    {"type": "text", "text": "Say hi.", "cache_control": cached},
                ],
            }
        ],
        "tools": tools,
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "session_id": "s-1"})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }


def test_the_billing_line_does_not_defeat_the_prefix_cache(servers: Servers) -> None:
    """Two requests of one tenant differing only in the billing line's `cch=`: the second reads
    at least 90% of its prompt from the cache; both count the same (the line is not rendered)."""
    client = servers.client()
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    usages = []
    for billing in ("a1b2c", "f9e8d"):
        body = claude_code_shaped(billing)
        # A short answer: the random model would write up to the window (the cache is the point).
        args = {k: v for k, v in body.items() if k not in ("stream", "context_management")} | {
            "max_tokens": 8
        }
        extra = {"context_management": body["context_management"]}
        with client.messages.stream(**args, extra_body=extra, extra_headers=headers) as stream:
            usages.append(stream.get_final_message().usage)
        counted = client.messages.count_tokens(
            model=body["model"], system=body["system"], messages=body["messages"], tools=body["tools"]
        ).input_tokens
        assert counted == usages[-1].input_tokens + (usages[-1].cache_read_input_tokens or 0)
    first, second = usages
    prompt = second.input_tokens + (second.cache_read_input_tokens or 0)
    assert prompt > 1000 and prompt == first.input_tokens + (first.cache_read_input_tokens or 0)
    assert (second.cache_read_input_tokens or 0) / prompt >= 0.9, second


# -- pool mode -------------------------------------------------------------------------------

_VARYING = ("id",)


def _answer(r: httpx.Response) -> dict[str, Any]:
    """Status, body and stream events with ids blanked and the prompt's split between cached and
    uncached tokens summed (the two modes share the engine, so its cache, in either order)."""

    def norm(value: Any) -> Any:
        if isinstance(value, dict):
            out = {k: ("*" if k in _VARYING else norm(v)) for k, v in value.items()}
            if "cache_read_input_tokens" in out:
                out["input_tokens"] += out.pop("cache_read_input_tokens")
            return out
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    if r.headers.get("content-type", "").startswith("text/event-stream"):
        body: Any = [norm(json.loads(line[6:])) for line in r.text.split("\n") if line.startswith("data: ")]
    else:
        body = norm(r.json())
    seen = ("x-batchgate-clamped-max-tokens", "x-batchgate-ignored", "retry-after")
    return {"status": r.status_code, "body": body, "headers": {h: r.headers.get(h) for h in seen}}


POOL_CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/messages", {"model": MODEL, "max_tokens": 6, "messages": user("One"), "temperature": 0}),
    (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 6, "messages": user("Two"), "temperature": 0, "stream": True},
    ),
    (
        "/v1/messages",
        {
            "model": "claude-haiku-4-5",
            "max_tokens": 50000,
            "messages": user("Three"),
            "temperature": 0,
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "stream": True,
        },
    ),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": user("Four"), "tools": [WEATHER]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": user("word " * WINDOW)}),
    ("/v1/messages", {"model": "gpt-4o", "max_tokens": 4, "messages": user("hi")}),
    ("/v1/messages", {"model": MODEL, "messages": user("hi")}),
]


def test_pool_mode_gives_the_same_answers_and_its_ledger_equals_their_usage(servers: Servers) -> None:
    headers = {"x-api-key": "sk-acme", "anthropic-version": "2023-06-01"}

    def ledger(url: str) -> tuple[int, int]:
        since = {"start_time": int(time.time()) - 3600}
        r = httpx.get(url + "/v1/usage", params=since, headers={"authorization": "Bearer sk-acme"})
        results = [x for bucket in r.json()["data"] for x in bucket["results"]]
        return sum(x["input_tokens"] for x in results), sum(x["output_tokens"] for x in results)

    before = ledger(servers.gateway.base_url)
    used = [0, 0]
    for path, body in POOL_CASES:
        answers = {}
        for name, server in (("local", servers.local), ("pool", servers.gateway)):
            r = httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)
            answers[name] = _answer(r)
            if name == "pool" and r.status_code == 200 and path == "/v1/messages":
                events = answers[name]["body"]
                message = events if isinstance(events, dict) else events[-2]  # message_delta's usage
                used[0] += message["usage"]["input_tokens"]
                used[1] += message["usage"]["output_tokens"]
        assert answers["local"] == answers["pool"], (path, body)
    deadline = time.monotonic() + 5
    while ledger(servers.gateway.base_url) != (before[0] + used[0], before[1] + used[1]):
        assert time.monotonic() < deadline, (ledger(servers.gateway.base_url), before, used)
        time.sleep(0.02)
