"""The pool for real: a gateway and two replicas as processes, real Redis, real HTTP."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pool.conftest import FREE_KEY, INTERNAL_TOKEN, PAID_KEY, PoolCluster, start, wait_ready


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def ok_count(values: dict) -> float:
    return values.get(("batchgate_requests_total", (("code", "2xx"),)), 0.0)


def chat(http: httpx.Client, model: str, i: int, *, key: str = PAID_KEY, stream: bool = False) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"request number {i}"}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    if not stream:
        r = http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert not any("error" in p for p in payloads), payloads
    return [p for p in payloads if p.get("usage")][-1]["usage"]


def test_uniform_load_is_spread_and_metrics_match(cluster: PoolCluster) -> None:
    before_gw = scrape(cluster.gateway.url)
    before = [ok_count(scrape(r.url)) for r in cluster.replicas]
    n = 40
    with httpx.Client(base_url=cluster.gateway.url, timeout=120) as http, ThreadPoolExecutor(8) as pool:
        usages = list(
            pool.map(
                lambda i: chat(
                    http, cluster.model, i, key=FREE_KEY if i % 4 == 0 else PAID_KEY, stream=i % 2 == 1
                ),
                range(n),
            )
        )
    after = [ok_count(scrape(r.url)) for r in cluster.replicas]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == n, served
    for count in served:
        assert 0.3 * n <= count <= 0.7 * n, served
    after_gw = scrape(cluster.gateway.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after_gw.get(key, 0.0) - before_gw.get(key, 0.0)

    assert delta("batchgate_requests_total", code="2xx") == n
    assert delta("batchgate_e2e_request_latency_seconds_count") == n
    # A gateway sees the first token only of streamed requests (half of them).
    assert delta("batchgate_time_to_first_token_seconds_count") == n // 2
    out_paid = sum(u["completion_tokens"] for i, u in enumerate(usages) if i % 4 != 0)
    out_free = sum(u["completion_tokens"] for i, u in enumerate(usages) if i % 4 == 0)
    assert delta("batchgate_tokens_total", direction="out", plan="paid") == out_paid == 4 * 30
    assert delta("batchgate_tokens_total", direction="out", plan="free") == out_free == 4 * 10
    # Replicas count the same requests under the plan the gateway vouched for.
    replica_free_out = sum(
        scrape(r.url).get(("batchgate_tokens_total", (("direction", "out"), ("plan", "free"))), 0.0)
        for r in cluster.replicas
    )
    assert replica_free_out >= out_free


def test_auth_is_enforced_at_the_gateway(cluster: PoolCluster) -> None:
    with httpx.Client(base_url=cluster.gateway.url, timeout=30) as http:
        body = {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-wrong"})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = http.post(
            "/v1/chat/completions",
            json=body | {"model": "nope"},
            headers={"authorization": f"Bearer {PAID_KEY}"},
        )
        assert r.status_code == 404
        assert http.get("/v1/models").status_code == 401  # with tenants, listing needs a key too
        models = http.get("/v1/models", headers={"authorization": f"Bearer {PAID_KEY}"}).json()
        assert [m["id"] for m in models["data"]] == [cluster.model]


def test_one_trace_spans_gateway_and_replica_with_genai_attributes(cluster: PoolCluster) -> None:
    assert cluster.otlp is not None
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    body = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "a secret prompt"}],
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {PAID_KEY}", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    with httpx.Client(base_url=cluster.gateway.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    response_id = json.loads(text.split("data: ", 2)[1])["id"]

    def chat_spans(spans: list) -> list:
        return [s for s in spans if s.trace_id == trace_id and s.name == f"chat {cluster.model}"]

    spans = cluster.otlp.wait_for(lambda spans: len(chat_spans(spans)) == 2)
    mine = [s for s in spans if s.trace_id == trace_id]
    services = {s.service for s in mine}
    assert "batchgate-gateway" in services
    assert services & {"batchgate-replica0", "batchgate-replica1"}
    by_service = {s.service: s for s in chat_spans(spans)}
    gw = by_service.pop("batchgate-gateway")
    (replica,) = by_service.values()
    for span in (gw, replica):
        a = span.attributes
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "batchgate"
        assert a["gen_ai.request.model"] == cluster.model
        assert a["gen_ai.request.max_tokens"] == 3
        assert a["gen_ai.request.temperature"] == 0.5
        assert abs(a["gen_ai.request.top_p"] - 0.9) < 1e-9
        assert a["gen_ai.response.id"] == response_id
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.usage.output_tokens"] == 3
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["batchgate.priority"] == "paid"
        assert {"gen_ai.admission", "gen_ai.first_token", "gen_ai.completion"} <= set(span.events)
        # Prompt text is not recorded unless the operator opts in.
        assert not any("secret prompt" in str(v) for v in a.values())
    assert gw.attributes["batchgate.tenant"] == "acme"
    # The replica's spans descend from the gateway's: its server span's parent is a gateway span.
    gateway_ids = {s.span_id for s in mine if s.service == "batchgate-gateway"}
    replica_roots = [s for s in mine if s.service == replica.service and s.parent_id in gateway_ids]
    assert replica_roots, [(s.service, s.name, s.parent_id) for s in mine]
    # The gateway's server span continued the client's traceparent.
    assert any(s.parent_id == "00f067aa0ba902b7" for s in mine if s.service == "batchgate-gateway")


def test_long_prompts_go_to_their_own_replica(cluster: PoolCluster, tmp_path: Path) -> None:
    """A second gateway over the same replicas, one of them reserved for prompts over 60 tokens."""
    short_replica, long_replica = cluster.replicas
    gateway = start(
        "gateway-by-length",
        [
            "--upstream",
            short_replica.url,
            "--long-prompt-upstream",
            long_replica.url,
            "--long-prompt-threshold",
            "60",
            "--internal-token",
            INTERNAL_TOKEN,
            "--health-interval",
            "0.2",
        ],
        tmp_path,
    )
    try:
        wait_ready([gateway])
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            deadline = time.monotonic() + 30
            while not all(u["healthy"] for u in upstreams_of(http)):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            document = " ".join(f"word{i}" for i in range(120))
            for i in range(6):
                long = i % 2 == 0
                content = f"{document} request {i}" if long else f"request {i}"
                body = {"model": cluster.model, "messages": [{"role": "user", "content": content}]}
                before = [ok_count(scrape(rep.url)) for rep in cluster.replicas]
                r = http.post("/v1/chat/completions", json=body | {"max_tokens": 2})
                assert r.status_code == 200, r.text
                served = [
                    ok_count(scrape(rep.url)) - b for rep, b in zip(cluster.replicas, before, strict=True)
                ]
                assert served == ([0, 1] if long else [1, 0]), (i, served)
            long_prompt = [u for u in upstreams_of(http) if u["long_prompts"]]
            assert [u["url"] for u in long_prompt] == [long_replica.url]
            assert long_prompt[0]["num_sent"] == 3
    finally:
        gateway.stop()


def upstreams_of(http: httpx.Client) -> list[dict]:
    r = http.get("/v1/internal/upstreams", headers={"x-batchgate-internal": INTERNAL_TOKEN})
    assert r.status_code == 200
    return r.json()


def test_killed_replica_gets_no_requests_and_the_pool_keeps_serving(cluster: PoolCluster) -> None:
    victim, survivor = cluster.replicas
    before = ok_count(scrape(survivor.url))
    victim.kill()
    n = 10
    with httpx.Client(base_url=cluster.gateway.url, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(lambda i: chat(http, cluster.model, i, stream=i % 2 == 0), range(n)))
        assert all(u["completion_tokens"] == 4 for u in usages)
        assert http.get("/ready").status_code == 200  # one healthy upstream is enough
    assert ok_count(scrape(survivor.url)) - before == n


def test_tool_calls_are_relayed_and_counted_like_content(cluster: PoolCluster) -> None:
    client = openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key=PAID_KEY, max_retries=0, timeout=60)
    pick = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    args: Any = dict(
        model=cluster.model,
        messages=[{"role": "user", "content": "Pick a color."}],
        tools=[{"type": "function", "function": {"name": "pick", "parameters": pick}}],
        tool_choice={"type": "function", "function": {"name": "pick"}},
        parallel_tool_calls=False,
        max_tokens=40,
    )
    before = scrape(cluster.gateway.url)
    with client.chat.completions.stream(**args, stream_options={"include_usage": True}) as stream:
        streamed = stream.get_final_completion()
    after = scrape(cluster.gateway.url)
    (call,) = streamed.choices[0].message.tool_calls or []
    assert call.function.name == "pick" and json.loads(call.function.arguments)["color"] in ("red", "green")
    assert streamed.choices[0].finish_reason == "tool_calls"
    # A stream of tool-call deltas has a first token, and its tokens are counted for the plan.
    ttft = ("batchgate_time_to_first_token_seconds_count", ())
    assert after.get(ttft, 0.0) - before.get(ttft, 0.0) == 1
    out = ("batchgate_tokens_total", (("direction", "out"), ("plan", "paid")))
    assert streamed.usage is not None
    assert after.get(out, 0.0) - before.get(out, 0.0) == streamed.usage.completion_tokens > 0
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.tool_calls and whole.choices[0].finish_reason == "tool_calls"
    # A schema the replica cannot compile is its 400, relayed.
    bad = {"type": "function", "function": {"name": "pick", "parameters": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**args, "tools": [bad]})
    assert info.value.param == "tools[0].function.parameters"


def test_a_stream_settles_the_replicas_exact_usage_without_showing_it(cluster: PoolCluster) -> None:
    """The gateway asks the replica for usage on every stream (a chunk may carry no text, so
    counting chunks is only an estimate) and keeps that chunk from a client that did not ask."""

    def tokens_out(values: dict) -> float:
        return sum(v for (name, labels), v in values.items() if name == "batchgate_tokens_total" and
                   ("direction", "out") in labels)  # fmt: skip

    before = tokens_out(scrape(cluster.gateway.url))
    body = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "count my tokens"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
    }
    with httpx.Client(base_url=cluster.gateway.url, timeout=60) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {PAID_KEY}"}
        ) as r:
            assert r.status_code == 200
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads and not any(p.get("usage") for p in payloads), payloads
    assert all(p["choices"] for p in payloads)
    assert tokens_out(scrape(cluster.gateway.url)) - before == 5


def alive(cluster: PoolCluster) -> list[Any]:
    """The replicas still running (an earlier test kills one)."""
    return [r for r in cluster.replicas if r.proc.poll() is None]


def test_a_replica_keeps_within_what_its_gateway_reserved(cluster: PoolCluster) -> None:
    """A chat request without max_tokens reserves DEFAULT_CHAT_MAX_TOKENS at the gateway: the
    replica is told, and generates no more."""
    url = alive(cluster)[0].url + "/v1/chat/completions"
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True}
    internal = {"x-batchgate-internal": INTERNAL_TOKEN}
    capped = httpx.post(url, json=body, headers={**internal, "x-batchgate-max-tokens": "3"}, timeout=60)
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 3
    below = httpx.post(
        url, json={**body, "max_tokens": 2}, headers={**internal, "x-batchgate-max-tokens": "50"}
    )
    assert below.json()["usage"]["completion_tokens"] == 2  # a cap above max_tokens changes nothing
    # Without the internal token the headers mean nothing.
    open_call = httpx.post(url, json={**body, "max_tokens": 6}, headers={"x-batchgate-max-tokens": "1"})
    assert open_call.json()["usage"]["completion_tokens"] == 6


def test_a_stream_the_client_cut_is_settled_with_what_the_replica_sent(cluster: PoolCluster) -> None:
    """Cut before the replica's usage chunk, a stream is settled with the usage the replica kept
    for it (not one token per chunk seen): the gateway's count equals the replicas' own."""

    def tokens_out(url: str) -> float:
        values = scrape(url)
        return sum(v for (name, labels), v in values.items() if name == "batchgate_tokens_total" and
                   ("direction", "out") in labels)  # fmt: skip

    urls = [cluster.gateway.url, *(r.url for r in alive(cluster))]
    before = [tokens_out(u) for u in urls]
    body = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=cluster.gateway.url, timeout=60) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {PAID_KEY}"}
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: ")
    # The replica notices the cut, keeps the usage; the gateway reads it and settles (bounded wait).
    deadline = time.monotonic() + 20
    while True:
        after = [tokens_out(u) for u in urls]
        gateway_delta = after[0] - before[0]
        replica_delta = sum(after[1:]) - sum(before[1:])
        if gateway_delta and replica_delta:
            break
        assert time.monotonic() < deadline, (gateway_delta, replica_delta)
        time.sleep(0.05)
    # At least the 2 tokens the client saw (its 3 data lines start with the role chunk), however
    # soon the replica noticed the cut; exactly what the replica sent.
    assert 2 <= gateway_delta < 300
    assert gateway_delta == replica_delta
