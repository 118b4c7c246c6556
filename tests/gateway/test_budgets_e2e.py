"""Budgets and the ledger end to end: real uvicorn, the real engine (tiny model), a real
redis-server, the openai SDK (with its default retries, which `x-should-retry: false` stops)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tenancy.billing import Price
from tests.gateway.conftest import LiveServer
from tests.pool.otlp_receiver import OTLPReceiver

MSG = [{"role": "user", "content": "Hello there"}]
MODEL = "tiny"
PRICE = Price(input=1_000_000, cached_input=500_000, output=4_000_000)  # $1 / $0.50 / $4 per 1M
ADMIN_KEY = "bg-admin-secret"
TENANTS = """
[prices.tiny]
input = 1.0
cached_input = 0.5
output = 4.0

[plans.paid]
priority = "paid"
tokens_per_minute = 100000
requests_per_minute = 6000
max_concurrent_requests = 100
queue_deadline_seconds = 30

[tenants.rich]
plan = "paid"
keys = ["{rich}"]

[tenants.capped]
plan = "paid"
keys = ["{capped}"]
budget_usd = 0.001            # 1,000 micro-dollars: room for a few small requests
budget_window = "daily"

[tenants.soft]
plan = "paid"
keys = ["{soft}"]
budget_tokens = 100000
budget_window = "monthly"
budget_soft_ratio = 0.0001    # 10 tokens: the first request crosses it

[tenants.metered]
plan = "paid"
keys = ["{metered}"]
budget_tokens = 1000000
budget_window = "none"
"""


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    import redis

    redis.Redis.from_url(redis_server).flushdb()
    workdir = tmp_path_factory.mktemp("budgets")
    tenants = workdir / "tenants.toml"
    tenants.write_text(
        TENANTS.format(
            rich=hash_key("sk-rich"),
            capped=hash_key("sk-capped"),
            metered=hash_key("sk-metered"),
            soft=hash_key("sk-soft"),
        )
    )
    hooks: list[dict[str, Any]] = []

    async def receive(request: Any) -> Any:
        from starlette.responses import Response

        hooks.append(await request.json())
        return Response(status_code=204)

    from starlette.applications import Starlette
    from starlette.routing import Route

    receiver = LiveServer(Starlette(routes=[Route("/hook", receive, methods=["POST"])]))
    otlp = OTLPReceiver()  # the usage events' OpenTelemetry logs sink sends here
    otel_env = {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": otlp.url + "/v1/logs", "OTEL_BLRP_SCHEDULE_DELAY": "50"}
    saved = {k: os.environ.get(k) for k in otel_env}
    os.environ.update(otel_env)  # read when the exporter is made, in create_app
    settings = Settings(
        usage_events_exporter="otlp",
        budget_webhook_url=receiver.base_url + "/hook",
        tenants=str(tenants),
        redis_url=redis_server,
        keep_alive_s=1.0,
        embedding_model="none",
        admin_key_hash=hash_key(ADMIN_KEY),
        usage_events_file=str(workdir / "usage.jsonl"),
    )
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            served_model_name=MODEL,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=32 << 20,
        )
    )
    try:
        app = create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    live = LiveServer(app)
    live.otlp = otlp  # type: ignore[attr-defined]
    live.events_file = workdir / "usage.jsonl"  # type: ignore[attr-defined]
    live.hooks = hooks  # type: ignore[attr-defined]
    try:
        yield live
    finally:
        live.stop()
        receiver.stop()
        otlp.stop()
        engine.shutdown()


def client(server: Any, key: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, **kwargs)


def usage_of(server: Any, key: str, **params: Any) -> dict[str, Any]:
    params.setdefault("start_time", int(time.time()) - 3600)
    response = httpx.get(
        server.base_url + "/v1/usage", params=params, headers={"authorization": f"Bearer {key}"}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def totals(body: dict[str, Any]) -> dict[str, int]:
    out = {"input_tokens": 0, "output_tokens": 0, "num_model_requests": 0, "cost_micros": 0}
    for bucket in body["data"]:
        for result in bucket["results"]:
            for name in out:
                out[name] += result[name]
    return out


def refusals(server: Any, reason: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(f'batchgate_refusals_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no refusals series for {reason}")


def test_the_ledger_equals_the_reported_usage_times_the_price(server: Any) -> None:
    sdk = client(server, "sk-rich", max_retries=0)
    reported = []
    for max_tokens in (3, 5, 7):
        reported.append(sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=max_tokens).usage)
    stream = sdk.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    reported.append([chunk for chunk in stream if chunk.usage][-1].usage)
    body = usage_of(server, "sk-rich", bucket_width="1h", group_by="model")
    got = totals(body)
    assert got["num_model_requests"] == 4
    assert got["input_tokens"] == sum(u.prompt_tokens for u in reported)
    assert got["output_tokens"] == sum(u.completion_tokens for u in reported)
    cost = sum(
        PRICE.cost(u.prompt_tokens, (u.prompt_tokens_details.cached_tokens or 0), u.completion_tokens)
        for u in reported
    )
    assert got["cost_micros"] == cost
    results = [r for b in body["data"] for r in b["results"]]
    assert {r["model"] for r in results} == {MODEL} and all("project_id" not in r for r in results)
    assert body["budgets"] == []


def test_a_budget_refusal_is_insufficient_quota_and_the_sdk_does_not_retry(server: Any) -> None:
    sdk = client(server, "sk-capped")  # the SDK's default: 2 retries of a 429 unless told not to
    # Worst case of ~20 prompt tokens + 100 output tokens at $1/$4 per 1M is ~420 micro-dollars.
    first = sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100)
    assert first.usage is not None
    before = refusals(server, "budget")
    with pytest.raises(openai.RateLimitError) as info:
        sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=250)
    assert refusals(server, "budget") == before + 1  # one attempt: no retry
    error = info.value
    assert error.status_code == 429 and error.code == "insufficient_quota"
    assert error.response.headers["x-should-retry"] == "false"
    assert "daily spend budget of $0.001" in error.message and "It resets at" in error.message
    state = usage_of(server, "sk-capped")["budgets"]
    spent = PRICE.cost(first.usage.prompt_tokens, 0, first.usage.completion_tokens)
    assert [(s["metric"], s["window"], s["limit"], s["used"], s["reserved"]) for s in state] == [
        ("usd", "daily", 1000, spent, 0)
    ]
    # What still fits is admitted: the refusal held nothing back.
    assert sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).usage is not None


def test_the_organization_usage_api_needs_the_admin_key(server: Any) -> None:
    url = server.base_url + "/v1/organization/usage/completions"
    params = {"start_time": int(time.time()) - 86400, "group_by": "project_id"}
    for headers in ({"authorization": "Bearer sk-rich"}, {"authorization": "Bearer nope"}, {}):
        response = httpx.get(url, params=params, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.get(url, params=params, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "page" and body["data"][0]["object"] == "bucket"
    tenants = {r["project_id"] for b in body["data"] for r in b["results"]}
    assert {"rich", "capped"} <= tenants
    csv_text = httpx.get(
        server.base_url + "/admin/usage.csv", params=params, headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ).text
    header, *lines = csv_text.splitlines()
    assert header.startswith("start_time,end_time,project_id,model")
    assert any(",rich," in line for line in lines)
    bad = httpx.get(url, params={"bucket_width": "1m"}, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bucket_width"


def test_a_stream_the_client_left_releases_its_hold_and_pays_for_what_was_sent(server: Any) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 300, "ignore_eos": True, "stream": True}
    headers = {"authorization": "Bearer sk-metered"}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: ")
    # The server notices the cut and settles (bounded wait): the hold is gone, the tokens sent paid.
    deadline = time.monotonic() + 10
    while True:
        body = usage_of(server, "sk-metered")
        (state,) = body["budgets"]
        if state["reserved"] == 0 and state["used"]:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    got = totals(body)
    assert got["num_model_requests"] == 1
    assert 2 <= got["output_tokens"] < 300  # the first event carries the role, no token
    assert state["used"] == got["input_tokens"] + got["output_tokens"]


def test_usage_event_lines_match_the_ledger_one_to_one(server: Any) -> None:
    sdk = client(server, "sk-rich", max_retries=0)
    for max_tokens in (2, 3):
        sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=max_tokens)
    events = [json.loads(line) for line in server.events_file.read_text().splitlines()]
    rich = [e for e in events if e["tenant"] == "rich"]
    assert len({e["request_id"] for e in rich}) == len(rich)  # one line per request
    got = totals(usage_of(server, "sk-rich", bucket_width="1h"))
    assert got["num_model_requests"] == len(rich)
    assert got["input_tokens"] == sum(e["input_tokens"] for e in rich)
    assert got["output_tokens"] == sum(e["output_tokens"] for e in rich)
    assert got["cost_micros"] == sum(e["cost_micros"] for e in rich)
    assert {e["model"] for e in rich} == {MODEL} and all(e["key_id"].startswith("key_") for e in rich)
    assert all(e["status"] == "served" and e["ended_at"] >= e["started_at"] for e in rich)
    spend = [
        line for line in httpx.get(server.base_url + "/metrics").text.splitlines()
        if line.startswith('batchgate_spend_micros_total{plan="paid"}')
    ]  # fmt: skip
    assert float(spend[0].split()[-1]) >= got["cost_micros"] > 0


def test_crossing_a_soft_threshold_counts_once_and_calls_the_webhook_once(server: Any) -> None:
    def crossings() -> float:
        for line in httpx.get(server.base_url + "/metrics").text.splitlines():
            if line.startswith('batchgate_budget_soft_crossings_total{metric="tokens",plan="paid"}'):
                return float(line.split()[-1])
        raise AssertionError("no soft crossings series")

    sdk = client(server, "sk-soft", max_retries=0)
    sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    deadline = time.monotonic() + 10
    while not server.hooks:
        assert time.monotonic() < deadline, "the webhook was not called"
        time.sleep(0.02)
    sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)  # past it already: no second call
    assert crossings() == 1
    (hook,) = server.hooks
    assert hook["type"] == "budget.soft_limit" and hook["tenant"] == "soft"
    assert (hook["metric"], hook["window"], hook["limit"], hook["soft_limit"]) == (
        "tokens",
        "monthly",
        100000,
        10,
    )


def test_usage_events_go_to_opentelemetry_logs_one_record_per_line(server: Any) -> None:
    """The OTLP/HTTP logs sink, decoded by a real receiver: one `batchgate.usage` record per
    usage-event line, with the same fields as attributes and the same JSON as body."""
    sdk = client(server, "sk-metered", max_retries=0)
    for max_tokens in (2, 4):
        sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=max_tokens)
    lines = [json.loads(line) for line in server.events_file.read_text().splitlines()]
    ids = {e["request_id"] for e in lines}
    logs = server.otlp.wait_for_logs(
        lambda got: {r.attributes.get("batchgate.request_id") for r in got} >= ids
    )
    records = [r for r in logs if r.attributes.get("batchgate.request_id") in ids]
    assert len(records) == len(lines) == len(ids)  # one to one
    by_id = {r.attributes["batchgate.request_id"]: r for r in records}
    for line in lines:
        record = by_id[line["request_id"]]
        assert record.event_name == "batchgate.usage" and json.loads(record.body) == line
        assert {k.removeprefix("batchgate."): v for k, v in record.attributes.items()} == pytest.approx(line)


def test_budget_gauges_by_plan_and_refusals_by_budget(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`batchgate_budget_used/limit{plan,metric}` sum the tenants' budgets as the store has them
    (read at scrape time); a budget refusal counts in `batchgate_budget_refusals_total`."""
    from prometheus_client.parser import text_string_to_metric_families

    import gateway.metrics

    monkeypatch.setattr(gateway.metrics, "BUDGET_GAUGE_TTL_S", 0.0)  # every scrape reads the store

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(server.base_url + "/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    refused = ("batchgate_budget_refusals_total", (("metric", "usd"), ("plan", "paid"), ("scope", "tenant")))
    before = samples().get(refused, 0.0)
    sdk = client(server, "sk-capped", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        for _ in range(50):  # 1,000 micro-dollars: a few requests fit, then the budget refuses
            sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16)
    got = samples()
    assert got[refused] == before + 1
    states = {
        name: httpx.get(
            server.base_url + f"/admin/tenants/{name}", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        ).json()["budgets"]
        for name in ("capped", "soft", "metered")
    }
    for metric, names in (("usd", ["capped"]), ("tokens", ["soft", "metered"])):
        labels = (("metric", metric), ("plan", "paid"))
        used = [states[n][0]["used"] for n in names]
        limits = [states[n][0]["limit"] for n in names]
        assert got[("batchgate_budget_used", labels)] == sum(used)
        assert got[("batchgate_budget_limit", labels)] == sum(limits)
        ratio = max(u / lim for u, lim in zip(used, limits, strict=True))
        assert got[("batchgate_budget_use_max_ratio", labels)] == pytest.approx(ratio)
    assert got[("batchgate_budget_used", (("metric", "usd"), ("plan", "paid")))] > 0  # capped's spend
    assert got[("batchgate_budget_used", (("metric", "usd"), ("plan", "free")))] == 0
