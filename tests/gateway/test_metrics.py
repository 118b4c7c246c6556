"""/metrics over the real server: counts and token totals match the requests sent."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import client_for


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def get(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_and_tokens(tiny_server) -> None:
    base = tiny_server.base_url
    with httpx.Client(base_url=base, timeout=60) as http:
        before = scrape(http.get("/metrics").text)
        prompt_tokens = out_tokens = cached_tokens = 0
        n = 4
        for i in range(n):
            body = {
                "model": tiny_server.model,
                "messages": [{"role": "user", "content": f"hello {i}"}],
                "max_tokens": 3,
                "ignore_eos": True,
            }
            if i % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                usage = [line for line in r.text.splitlines() if '"usage":{' in line][-1]
                import json

                u = json.loads(usage.removeprefix("data: "))["usage"]
            else:
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                u = r.json()["usage"]
            prompt_tokens += u["prompt_tokens"]
            out_tokens += u["completion_tokens"]
            cached_tokens += u["prompt_tokens_details"]["cached_tokens"]
        bad = http.post("/v1/chat/completions", json={"model": tiny_server.model})
        assert bad.status_code == 400
        r = http.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        after = scrape(r.text)

    def delta(name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    assert delta("batchgate_requests_total", code="2xx") == n
    assert delta("batchgate_requests_total", code="4xx") == 1
    assert delta("batchgate_e2e_request_latency_seconds_count") == n + 1
    assert delta("batchgate_time_to_first_token_seconds_count") == n
    assert delta("batchgate_queue_time_seconds_count") == n
    assert delta("batchgate_inter_token_latency_seconds_count") == n * 2  # 3 tokens: 2 gaps each
    assert delta("batchgate_tokens_total", direction="in", plan="open") == prompt_tokens
    assert delta("batchgate_tokens_total", direction="out", plan="open") == out_tokens == 3 * n
    for priority in ("paid", "free"):
        assert ("batchgate_requests_waiting", (("priority", priority),)) in after
        assert ("batchgate_requests_running", (("priority", priority),)) in after
    assert 0.0 <= get(after, "batchgate_kv_cache_usage_ratio") <= 1.0
    assert ("batchgate_batch_size", ()) in after
    assert ("batchgate_preemptions_total", ()) in after
    # Every prompt was looked up once; what usage reported cached is what the cache counted.
    assert delta("batchgate_prefix_cache_queries_total") == prompt_tokens
    assert delta("batchgate_prefix_cache_hits_total") == cached_tokens > 0
    for reason in ("rate_limit", "deadline", "overload", "unavailable"):
        assert ("batchgate_refusals_total", (("reason", reason),)) in after
    assert get(after, "batchgate_engine_up") == 1
    assert 0.0 <= get(after, "batchgate_engine_stalled_seconds") < 10.0
    for stage in ("forward", "sampling", "output", "schedule"):
        assert ("batchgate_engine_step_failures_total", (("stage", stage),)) in after


async def test_each_app_has_its_own_registry(fake_engine) -> None:
    a = create_app(Settings(), engine=fake_engine)
    b = create_app(Settings(), engine=fake_engine)
    assert a.state.gateway.metrics.registry is not b.state.gateway.metrics.registry
    async with client_for(a) as client:
        r = await client.get("/metrics")
        assert "batchgate_requests_waiting" in r.text


async def test_internal_stats_needs_the_token(fake_engine) -> None:
    app = create_app(Settings(internal_token="s3cret"), engine=fake_engine)
    async with client_for(app) as client:
        assert (await client.get("/v1/internal/stats")).status_code == 401
        r = await client.get("/v1/internal/stats", headers={"x-batchgate-internal": "s3cret"})
        assert r.status_code == 200
        assert {"num_waiting_tokens", "num_running_tokens"} <= r.json().keys()


async def test_rate_limit_refusals_and_tokens_by_plan(make_app, fake_engine, tmp_path) -> None:
    import tenancy

    path = tmp_path / "tenants.toml"
    path.write_text(
        f"""
[plans.free]
priority = "free"
tokens_per_minute = 100000
requests_per_minute = 2
max_concurrent_requests = 4
queue_deadline_seconds = 5

[tenants.acme]
plan = "free"
keys = ["{tenancy.hash_key("sk-acme")}"]
"""
    )
    t = tenancy.Tenancy.from_settings(str(path), None)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    auth = {"Authorization": "Bearer sk-acme"}
    async with client_for(make_app(tenancy=t)) as c:
        for expected in (200, 200, 429):
            assert (await c.post("/v1/chat/completions", json=body, headers=auth)).status_code == expected
        values = scrape((await c.get("/metrics")).text)
    await t.aclose()
    assert get(values, "batchgate_refusals_total", reason="rate_limit") == 1
    assert get(values, "batchgate_requests_total", code="2xx") == 2
    assert get(values, "batchgate_requests_total", code="4xx") == 1
    assert get(values, "batchgate_tokens_total", direction="out", plan="free") == 8
    assert get(values, "batchgate_tokens_total", direction="out", plan="paid") == 0
    # No tenant name or key anywhere in the exposition.
    text_values = " ".join(k[0] + str(k[1]) for k in values)
    assert "acme" not in text_values and "sk-" not in text_values


async def test_replica_trusts_priority_headers_only_with_the_internal_token(make_app, fake_engine) -> None:
    from engine.types import Priority

    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    vouched = {
        "x-batchgate-internal": "s3cret",
        "x-batchgate-priority": "free",
        "x-batchgate-deadline": "2.5",
        "x-batchgate-plan": "free",
        "x-batchgate-fairness": "acme",
    }
    async with client_for(make_app(internal_token="s3cret")) as c:
        assert (await c.post("/v1/chat/completions", json=body, headers=vouched)).status_code == 200
        forged = vouched | {"x-batchgate-internal": "wrong"}
        assert (await c.post("/v1/chat/completions", json=body, headers=forged)).status_code == 200
        values = scrape((await c.get("/metrics")).text)
    trusted, untrusted = fake_engine.submitted
    assert (trusted.priority, trusted.queue_deadline_s, trusted.fairness_key) == (Priority.FREE, 2.5, "acme")
    assert (untrusted.priority, untrusted.queue_deadline_s) == (Priority.PAID, None)
    assert get(values, "batchgate_tokens_total", direction="out", plan="free") > 0


async def test_engine_liveness_series_follow_the_engine(make_app, fake_engine) -> None:
    fake_engine.step_failures_by_stage = {"forward": 2, "output": 1}
    async with client_for(make_app()) as client:
        values = scrape((await client.get("/metrics")).text)
        assert get(values, "batchgate_engine_up") == 1
        assert get(values, "batchgate_engine_stalled_seconds") == 0
        assert get(values, "batchgate_engine_step_failures_total", stage="forward") == 2
        assert get(values, "batchgate_engine_step_failures_total", stage="output") == 1
        assert ("batchgate_engine_step_failures_total", (("stage", "sampling"),)) in values
        fake_engine.stalled_s = 75.5
        values = scrape((await client.get("/metrics")).text)
        assert get(values, "batchgate_engine_stalled_seconds") == 75.5
        fake_engine.ready = False
        values = scrape((await client.get("/metrics")).text)
        assert get(values, "batchgate_engine_up") == 0


def test_a_gateway_without_a_local_engine_has_no_liveness_series() -> None:
    """Gateway-only mode: nothing to be up or stalled, so no series an alert could mistake for a
    dead engine."""
    from prometheus_client import generate_latest

    from gateway.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    assert "batchgate_requests_waiting" in text and "batchgate_engine_" not in text
