"""End to end: a real uvicorn server over the real engine (tiny random model), driven by the openai SDK."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import TINY_MAX_MODEL_LEN, TINY_MAX_NUM_SEQS, TinyServer

MSG = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def server(tiny_server: TinyServer) -> TinyServer:
    yield tiny_server
    tiny_server.wait_idle()  # every test leaves the engine with all blocks free


@pytest.fixture
def client(server: TinyServer) -> openai.OpenAI:
    return server.openai()


def test_models_list(client: openai.OpenAI, server: TinyServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model


def test_chat_non_stream_with_usage(client: openai.OpenAI, server: TinyServer) -> None:
    r = client.chat.completions.create(model=server.model, messages=MSG, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == server.model
    (choice,) = r.choices
    assert (
        choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    )
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 0
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream_at_temperature_0(client: openai.OpenAI, server: TinyServer) -> None:
    args: dict[str, Any] = dict(model=server.model, messages=MSG, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    streamed_usage, whole_usage = usage.usage.model_dump(), whole.usage.model_dump()
    # The repeat found the prompt's full blocks in the prefix cache, and says so.
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] >= 16
    whole_usage.pop("prompt_tokens_details")
    assert streamed_usage == whole_usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage(client: openai.OpenAI, server: TinyServer) -> None:
    chunks = list(client.chat.completions.create(model=server.model, messages=MSG, max_tokens=4, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_finish_reason_length_at_max_tokens(client: openai.OpenAI, server: TinyServer) -> None:
    r = client.chat.completions.create(
        model=server.model, messages=MSG, max_completion_tokens=7, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7


def test_stop_string(client: openai.OpenAI, server: TinyServer) -> None:
    args: dict[str, Any] = dict(
        model=server.model, messages=MSG, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(**args, max_tokens=30).choices[0].message.content
    assert full is not None and len(full) > 12
    stop = full[8:12]
    r = client.chat.completions.create(**args, max_tokens=30, stop=[stop, "\x00never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_n2(client: openai.OpenAI, server: TinyServer) -> None:
    args: dict[str, Any] = dict(
        model=server.model, messages=MSG, max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    r = client.chat.completions.create(**args)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 12  # counted over both choices
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = {0: "", 1: ""}
    for c in chunks:
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
    assert streamed == {c.index: c.message.content for c in r.choices}  # same seed, same two choices


def test_same_seed_same_output_at_temperature_08(client: openai.OpenAI, server: TinyServer) -> None:
    args: dict[str, Any] = dict(model=server.model, messages=MSG, max_tokens=16, temperature=0.8, seed=1234)
    first = client.chat.completions.create(**args).choices[0].message.content
    second = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    )
    assert first == second == streamed


def test_tiny_top_p(client: openai.OpenAI, server: TinyServer) -> None:
    # 5e-324 is a valid top_p (> 0); it keeps only the most likely token, i.e. it is greedy.
    args: dict[str, Any] = dict(
        model=server.model, messages=MSG, max_tokens=6, extra_body={"ignore_eos": True}
    )
    tiny = client.chat.completions.create(**args, top_p=5e-324).choices[0].message.content
    assert tiny == client.chat.completions.create(**args, temperature=0).choices[0].message.content


def test_logprobs(client: openai.OpenAI, server: TinyServer) -> None:
    r = client.chat.completions.create(
        model=server.model, messages=MSG, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for lp in content:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-4)  # greedy takes the top token
    if r.choices[0].finish_reason == "length":  # no EOS among the tokens: their bytes are the text
        assert b"".join(bytes(lp.bytes) for lp in content).decode() == r.choices[0].message.content


def test_completions(client: openai.OpenAI, server: TinyServer) -> None:
    r = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage is not None and r.usage.prompt_tokens > 0
    streamed = list(
        client.completions.create(
            model=server.model,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    assert (
        streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == r.usage.completion_tokens
    )

    r = client.completions.create(model=server.model, prompt=["a", "b"], max_tokens=3, n=2, echo=True)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert [c.text[:1] for c in sorted(r.choices, key=lambda c: c.index)] == ["a", "a", "b", "b"]


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"n": 0}, "n", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_tokens": 10 * TINY_MAX_MODEL_LEN}, "messages", "context_length_exceeded"),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[0].function.parameters",
            None,
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
            None,
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format.json_schema.schema",
            None,
        ),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions", None),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
    ],
)
def test_bad_request_error(
    client: openai.OpenAI, server: TinyServer, kwargs: dict[str, Any], param: str, code: str | None
) -> None:
    args: dict[str, Any] = {"model": server.model, "messages": MSG, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.type == "invalid_request_error"
    assert info.value.param == param and info.value.code == code
    if code == "context_length_exceeded":
        message = info.value.body["message"]  # type: ignore[index]
        assert str(TINY_MAX_MODEL_LEN) in message and str(10 * TINY_MAX_MODEL_LEN) in message


def test_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    assert info.value.code == "model_not_found" and info.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_disconnect_mid_stream_frees_every_block(server: TinyServer) -> None:
    body = {"model": server.model, "messages": MSG, "max_tokens": 800, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 5:
                    break
            assert server.engine.stats().num_running == 1  # still generating when the client goes
    stats = server.wait_idle(timeout_s=10)  # the engine aborted it at its next iteration
    assert stats.num_free_blocks == stats.num_total_blocks


def test_health_answers_fast_while_the_engine_is_full(server: TinyServer) -> None:
    num_requests = TINY_MAX_NUM_SEQS + 8  # more than fit: some wait in the queue too
    stop = threading.Event()
    body = {"model": server.model, "messages": MSG, "max_tokens": 600, "stream": True, "ignore_eos": True}

    def long_request() -> int:
        n = 0
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    n += line.startswith("data: ")
                    if stop.is_set():
                        break
        return n

    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(long_request) for _ in range(num_requests)]
        try:
            deadline = time.monotonic() + 30
            # Measure only once the engine is full and requests queue behind it (the threads'
            # requests arrive in their own time).
            while (stats := server.engine.stats()).num_running < TINY_MAX_NUM_SEQS or not stats.num_waiting:
                assert time.monotonic() < deadline, stats
                time.sleep(0.02)
            latencies = []
            # The session's heap (hundreds of tests' objects) is not the server's: keep the test
            # process's full GC collections (0.2-0.3 s here) out of the server's latency.
            gc.collect()
            gc.freeze()
            with httpx.Client(base_url=server.base_url, timeout=5) as http:
                http.get("/health")  # connection set up outside the measurement
                for _ in range(20):
                    start = time.perf_counter()
                    r = http.get("/health")
                    latencies.append(time.perf_counter() - start)
                    assert r.status_code == 200
            stats = server.engine.stats()
            assert stats.num_running == TINY_MAX_NUM_SEQS and stats.num_waiting > 0
        finally:
            stop.set()
        num_events = [f.result(timeout=30) for f in futures]
        # The running ones streamed; the queued ones may have seen only keep-alive comments.
        assert sum(n > 0 for n in num_events) >= TINY_MAX_NUM_SEQS, num_events
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.05, latencies  # median well inside 50 ms
    assert latencies[-2] < 0.05, latencies


def test_raw_sse_wire_format(server: TinyServer) -> None:
    body = {"model": server.model, "messages": MSG, "max_tokens": 3, "stream": True}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
    frames = r.text.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    for frame in frames[:-2]:
        assert frame.startswith("data: {")
        json.loads(frame.removeprefix("data: "))
