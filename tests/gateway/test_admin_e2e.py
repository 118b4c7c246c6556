"""The admin API end to end: two gateways (real uvicorn, fake engines) over one real redis-server.

A change made through one gateway applies on the other within a second (its poll), revocation
at once (every lookup checks Redis), and no raw key is ever stored or logged."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tenancy.billing import Price
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import validate_answer, validate_request

ADMIN_KEY = "bg-admin-root"
SEED_KEY = "sk-seed"
TENANTS = f"""
[prices."fake-model"]
input = 1.0
output = 4.0

[plans.paid]
priority = "paid"
tokens_per_minute = 100000
requests_per_minute = 6000
max_concurrent_requests = 100
queue_deadline_seconds = 30

[tenants.seed]
plan = "paid"
keys = ["{hash_key(SEED_KEY)}"]
"""


@pytest.fixture
def gateways(redis_url: str, tmp_path: Path) -> Iterator[list[Any]]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = Settings(
        tenants=str(tenants),
        redis_url=redis_url,
        keep_alive_s=1.0,
        embedding_model="none",
        admin_key_hash=hash_key(ADMIN_KEY),
    )
    servers = []
    try:
        for _ in range(2):
            tenancy = build_tenancy(settings)
            app = create_app(settings, engine=FakeEngine(), tenancy=tenancy, owns_tenancy=True)
            live = LiveServer(app)
            live.app = app  # type: ignore[attr-defined]
            servers.append(live)
        yield servers
    finally:
        for server in servers:
            server.stop()


def admin(server: Any, method: str, path: str, body: Any = None, key: str = ADMIN_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=10)


def chat(server: Any, key: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def until(predicate: Any, within_s: float) -> float:
    """Seconds until `predicate()` holds; fails past `within_s` (a bound, not a sleep)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_tenant_keys_and_no_key_are_401_on_admin_routes(gateways: list[Any]) -> None:
    for key in (SEED_KEY, "", "bg-wrong"):
        response = admin(gateways[0], "GET", "/admin/tenants", key=key)
        assert response.status_code == 401, key
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert admin(gateways[0], "GET", "/admin/tenants").status_code == 200


def test_a_tenant_and_key_made_on_one_gateway_serve_on_the_other_within_a_second(
    gateways: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="batchgate")
    a, b = gateways
    gold = {
        "priority": "paid",
        "tokens_per_minute": 100000,
        "requests_per_minute": 6000,
        "max_concurrent_requests": 10,
        "queue_deadline_seconds": 10,
    }
    assert admin(a, "PUT", "/admin/plans/gold", gold).status_code == 200
    made = admin(a, "PUT", "/admin/tenants/newco", {"plan": "gold"})
    assert made.status_code == 200 and made.json()["plan"] == "gold"
    issued = admin(a, "POST", "/admin/tenants/newco/keys", {"name": "ci"})
    assert issued.status_code == 201
    raw, key_hash = issued.json()["key"], issued.json()["key_hash"]
    assert key_hash == hash_key(raw)
    assert until(lambda: chat(b, raw).status_code == 200, within_s=1.0) < 1.0

    # A budget set at run time applies to the next request on every gateway (after their poll).
    tight = {"plan": "gold", "budget_tokens": 1, "budget_window": "daily"}
    assert admin(a, "PUT", "/admin/tenants/newco", tight).status_code == 200
    assert until(lambda: chat(b, raw).status_code == 429, within_s=1.0) < 1.0
    refused = chat(a, raw).json()["error"]
    assert refused["code"] == "insufficient_quota" and "daily token budget of 1 tokens" in refused["message"]
    state = admin(b, "GET", "/admin/tenants/newco").json()["budgets"]
    assert [(s["metric"], s["limit"]) for s in state] == [("tokens", 1)]

    # Revoked: a 401 at once, on both.
    listed = admin(b, "GET", "/admin/tenants/newco/keys").json()["data"]
    assert [(k["key_hash"], k["name"], k["active"]) for k in listed] == [(key_hash, "ci", True)]
    assert admin(a, "DELETE", f"/admin/keys/{key_hash}").status_code == 200
    assert chat(b, raw).status_code == 401 and chat(a, raw).status_code == 401

    # The audit log says who did what, and no raw key is anywhere: audit, Redis, logs.
    audit = admin(b, "GET", "/admin/audit").json()["data"]
    actions = [e["action"] for e in reversed(audit)]
    assert actions == ["plan.put", "tenant.put", "key.issue", "tenant.put", "key.revoke"]
    assert all(e["actor"].startswith("admin@") for e in audit)
    client = redis.Redis.from_url(a.app.state.gateway.settings.redis_url, decode_responses=True)
    try:
        stored = json.dumps(audit)
        read = {  # every type Redis has: a key of another type fails the test
            "hash": client.hgetall,
            "string": client.get,
            "stream": client.xrange,
            "set": lambda k: sorted(client.smembers(k)),
            "zset": lambda k: client.zrange(k, 0, -1, withscores=True),
            "list": lambda k: client.lrange(k, 0, -1),
        }
        for name in client.scan_iter():
            stored += name + json.dumps(read[client.type(name)](name))
    finally:
        client.close()
    assert key_hash in stored
    for secret in (raw, ADMIN_KEY, SEED_KEY):
        assert secret not in stored and secret not in caplog.text


def test_rotation_and_expiry(gateways: list[Any]) -> None:
    a, b = gateways
    issued = admin(
        a, "POST", "/admin/tenants/seed/keys", {"name": "rotating", "expires_at": time.time() + 3600}
    )
    old = issued.json()["key"]
    assert chat(b, old).status_code == 200
    rotated = admin(a, "POST", f"/admin/keys/{issued.json()['key_hash']}/rotate")
    assert rotated.status_code == 201
    new = rotated.json()["key"]
    assert chat(b, old).status_code == 401 and chat(b, new).status_code == 200
    # An hour later (the gateway's clock moved, no sleep) the rotated key, which kept the expiry, is dead.
    b.app.state.gateway.tenancy._keys._wall = lambda: time.time() + 3601
    assert chat(b, new).status_code == 401
    assert chat(b, SEED_KEY).status_code == 200  # static keys do not expire


def test_changes_the_rules_refuse_are_400s_naming_the_field(gateways: list[Any]) -> None:
    a = gateways[0]
    bad = admin(a, "PUT", "/admin/plans/broken", {"priority": "gold"})
    assert bad.status_code == 400 and "plans.broken" in bad.json()["error"]["message"]
    spare = {
        k: v for k, v in admin(a, "GET", "/admin/plans/paid").json().items() if k not in ("object", "id")
    }
    assert admin(a, "PUT", "/admin/plans/spare", spare).status_code == 200
    in_use = admin(a, "DELETE", "/admin/plans/paid")
    assert (
        in_use.status_code == 400
        and "tenants.seed.plan: unknown plan 'paid'" in in_use.json()["error"]["message"]
    )
    assert admin(a, "DELETE", "/admin/tenants/nosuch").status_code == 404
    assert admin(a, "POST", "/admin/tenants/nosuch/keys").status_code == 404
    keys = admin(a, "PUT", "/admin/tenants/seed", {"plan": "paid", "keys": []})
    assert keys.status_code == 400 and "keys API" in keys.json()["error"]["message"]
    # A tenant deleted through the API is gone even though the file has it, and its key with it.
    assert admin(a, "PUT", "/admin/tenants/other", {"plan": "paid"}).status_code == 200
    assert admin(a, "DELETE", "/admin/tenants/seed").status_code == 200
    assert chat(a, SEED_KEY).status_code == 401


def test_many_concurrent_requests_over_two_gateways_never_overshoot_a_budget(gateways: list[Any]) -> None:
    """Room for about 10 requests' worst case; 120 at once over both gateways: the settled spend
    never exceeds the budget, every refusal is insufficient_quota, and the spend is exactly the
    accepted requests' usage at the price."""
    from concurrent.futures import ThreadPoolExecutor

    a, b = gateways
    price = Price(input=1_000_000, cached_input=1_000_000, output=4_000_000)
    probe = chat(a, SEED_KEY, max_tokens=8).json()["usage"]
    worst = price.cost(probe["prompt_tokens"], 0, 8)
    budget = 10 * worst + worst // 2  # ten worst cases and a half
    table = {"plan": "paid", "budget_usd": budget / 1_000_000, "budget_window": "monthly"}
    assert admin(a, "PUT", "/admin/tenants/capped", table).status_code == 200
    raw = admin(a, "POST", "/admin/tenants/capped/keys").json()["key"]
    until(lambda: chat(b, raw, max_tokens=1).status_code == 200, within_s=1.0)
    spent_before = admin(b, "GET", "/admin/tenants/capped").json()["budgets"][0]["used"]  # that first call
    with ThreadPoolExecutor(12) as pool:  # 2 CPUs in CI: more threads only queue in the client
        responses = list(pool.map(lambda i: chat(gateways[i % 2], raw, max_tokens=8), range(120)))
    accepted = [r.json()["usage"] for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert 1 <= len(accepted) <= 10
    assert refused and all(
        r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota" for r in refused
    )
    spent = spent_before + sum(price.cost(u["prompt_tokens"], 0, u["completion_tokens"]) for u in accepted)
    # A read on each gateway: each comes after the settlements its gateway sent, so the last sees all.
    (state,) = [admin(g, "GET", "/admin/tenants/capped").json()["budgets"] for g in (a, b)][-1]
    assert state["used"] == spent <= budget and state["reserved"] == 0


def test_a_key_has_its_own_budget_beside_its_tenants(gateways: list[Any]) -> None:
    a, b = gateways
    probe = chat(a, SEED_KEY, max_tokens=2).json()["usage"]
    room = 2 * (probe["prompt_tokens"] + 2) + 1  # two requests' worst case, not three
    body = {"name": "metered", "budgets": {"budget_tokens": room, "budget_window": "daily"}}
    issued = admin(a, "POST", "/admin/tenants/seed/keys", body).json()
    key, key_hash = issued["key"], issued["key_hash"]
    assert [chat(b, key).status_code for _ in range(3)] == [200, 200, 429]
    error = chat(a, key).json()["error"]
    assert error["code"] == "insufficient_quota" and "this API key's daily token budget" in error["message"]
    assert chat(b, SEED_KEY).status_code == 200  # the tenant's other key is not held by it
    (listed,) = [
        k for k in admin(b, "GET", "/admin/tenants/seed/keys").json()["data"] if k["key_hash"] == key_hash
    ]
    assert listed["budgets"] == {"budget_tokens": room, "budget_window": "daily"}
    bad = admin(a, "PUT", f"/admin/keys/{key_hash}/budgets", {"budget_tokens": -1, "budget_window": "daily"})
    assert (
        bad.status_code == 400
        and f"keys.key_{key_hash[7:23]}.budget_tokens" in bad.json()["error"]["message"]
    )
    assert admin(a, "PUT", f"/admin/keys/{key_hash}/budgets", {}).status_code == 200
    assert chat(b, key).status_code == 200  # no budget of its own any more: the next request runs


def test_a_price_changed_on_one_gateway_applies_to_the_next_request_on_the_other(gateways: list[Any]) -> None:
    a, b = gateways
    table = {"plan": "paid", "budget_usd": 100.0, "budget_window": "monthly"}
    assert admin(a, "PUT", "/admin/tenants/metered", table).status_code == 200
    raw = admin(a, "POST", "/admin/tenants/metered/keys").json()["key"]
    until(lambda: chat(b, raw).status_code == 200, within_s=1.0)

    def spent(server: Any) -> int:
        return int(admin(server, "GET", "/admin/tenants/metered").json()["budgets"][0]["used"])

    def charged(server: Any) -> tuple[dict[str, int], int]:
        # Read on the gateway that answered: it reads after the settlements it sent (a read on
        # the other may come a round trip before them; docs/OPERATIONS.md).
        before = spent(server)
        usage = chat(server, raw).json()["usage"]
        return usage, spent(server) - before

    usage, cost = charged(b)
    file_price = Price(input=1_000_000, cached_input=1_000_000, output=4_000_000)
    assert cost == file_price.cost(usage["prompt_tokens"], 0, usage["completion_tokens"]) > 0

    dearer = {"input": 3.0, "cached_input": 1.5, "output": 12.0}
    put = admin(a, "PUT", "/admin/prices/fake-model", dearer)
    assert put.status_code == 200 and put.json() == {"object": "price", "id": "fake-model", **dearer}
    new_price = Price(input=3_000_000, cached_input=1_500_000, output=12_000_000)
    tenancy_b = b.app.state.gateway.tenancy
    until(lambda: tenancy_b.config.price("fake-model") == new_price, within_s=1.0)  # b's poll
    for server in (b, a):  # the next request on either gateway reserves and pays the new price
        usage, cost = charged(server)
        assert cost == new_price.cost(usage["prompt_tokens"], 0, usage["completion_tokens"]) > 0

    # A name with a slash, a bad table (400 naming the field), a delete: the model is then free.
    assert admin(a, "PUT", "/admin/prices/org/other-model", {"input": 1, "output": 1}).status_code == 200
    assert admin(b, "GET", "/admin/prices/org/other-model").json()["id"] == "org/other-model"
    bad = admin(a, "PUT", "/admin/prices/fake-model", {"input": 1.0})
    assert bad.status_code == 400 and 'prices."fake-model".output' in bad.json()["error"]["message"]
    listed = admin(b, "GET", "/admin/prices").json()["data"]
    assert [p["id"] for p in listed] == ["fake-model", "org/other-model"]
    assert admin(a, "DELETE", "/admin/prices/fake-model").status_code == 200
    assert admin(a, "DELETE", "/admin/prices/fake-model").status_code == 404
    until(lambda: tenancy_b.config.price("fake-model").output == 0, within_s=1.0)
    assert charged(b)[1] == 0

    audit = admin(b, "GET", "/admin/audit").json()["data"]
    prices = [(e["action"], e["target"]) for e in reversed(audit) if e["action"].startswith("price.")]
    assert prices == [
        ("price.put", "price:fake-model"),
        ("price.put", "price:org/other-model"),
        ("price.delete", "price:fake-model"),
    ]
    assert next(e for e in audit if e["action"] == "price.put")["detail"] == {"input": 1, "output": 1}


def test_every_admin_answer_is_one_the_openapi_document_names(gateways: list[Any]) -> None:
    """Each admin route's answers (successes and errors) match /openapi.json, and the bodies the
    document accepts are the ones the server accepts."""
    a = gateways[0]
    doc = httpx.get(a.base_url + "/openapi.json", timeout=10).json()
    plan = {k: v for k, v in admin(a, "GET", "/admin/plans/paid").json().items() if k not in ("object", "id")}
    plan |= {"budget_usd": 5.0, "budget_window": "monthly", "budget_soft_ratio": 0.8}
    calls: list[tuple[str, str, str, Any]] = [  # method, template, path, body
        ("GET", "/admin/plans", "/admin/plans", None),
        ("PUT", "/admin/plans/{name}", "/admin/plans/gold", plan),
        ("GET", "/admin/plans/{name}", "/admin/plans/gold", None),
        ("PUT", "/admin/plans/{name}", "/admin/plans/bad", {**plan, "colour": "red"}),
        ("PUT", "/admin/tenants/{name}", "/admin/tenants/newco", {"plan": "gold", "budget_tokens": 10**6}),
        ("GET", "/admin/tenants/{name}", "/admin/tenants/newco", None),
        ("GET", "/admin/tenants", "/admin/tenants", None),
        ("PUT", "/admin/tenants/{name}", "/admin/tenants/newco", {"plan": "gold", "keys": []}),
        ("GET", "/admin/tenants/{name}", "/admin/tenants/nosuch", None),
        ("PUT", "/admin/prices/{name}", "/admin/prices/org/model", {"input": 1.0, "output": 2.5}),
        ("GET", "/admin/prices/{name}", "/admin/prices/org/model", None),
        ("GET", "/admin/prices", "/admin/prices", None),
        ("PUT", "/admin/prices/{name}", "/admin/prices/org/model", {"input": 1.0}),
        ("DELETE", "/admin/prices/{name}", "/admin/prices/org/model", None),
        ("POST", "/admin/tenants/{name}/keys", "/admin/tenants/newco/keys", None),
        (
            "POST",
            "/admin/tenants/{name}/keys",
            "/admin/tenants/newco/keys",
            {
                "name": "ci",
                "expires_at": time.time() + 60,
                "budgets": {"budget_usd": 1, "budget_window": "daily"},
            },
        ),
        ("POST", "/admin/tenants/{name}/keys", "/admin/tenants/newco/keys", {"label": "ci"}),
        ("POST", "/admin/tenants/{name}/keys", "/admin/tenants/newco/keys", ["ci"]),
        ("GET", "/admin/tenants/{name}/keys", "/admin/tenants/newco/keys", None),
        ("GET", "/admin/tenants/{name}/keys", "/admin/tenants/seed/keys", None),
        ("GET", "/admin/audit", "/admin/audit?limit=3", None),
        ("GET", "/admin/loras", "/admin/loras", None),
        ("PUT", "/admin/loras/{name}", "/admin/loras/x", {"path": "/nowhere"}),
        ("PUT", "/admin/loras/{name}", "/admin/loras/x", {"path": "/nowhere", "rank": 8}),
        ("DELETE", "/admin/loras/{name}", "/admin/loras/x", None),
    ]
    statuses = []
    for method, template, path, body in calls:
        response = admin(a, method, path, body)
        validate_answer(doc, method, template, response)
        statuses.append(response.status_code)
        if body is not None:  # what the schema refuses, the server refuses (and the other way)
            accepted = validate_request(doc, method, template, body)
            assert accepted == (response.status_code < 400) or template.startswith("/admin/loras"), (
                path,
                body,
                response.text,
            )
        if template == "/admin/tenants/{name}/keys" and response.status_code == 201:
            key_hash = response.json()["key_hash"]
    assert statuses[:9] == [200, 200, 200, 400, 200, 200, 200, 400, 404]  # plans, tenants
    assert statuses[9:14] == [200, 200, 200, 400, 200]  # prices
    assert statuses[14:] == [201, 201, 400, 400, 200, 200, 200, 200, 400, 400, 404]  # keys, audit, loras
    for method, template, body in (
        ("PUT", "/admin/keys/{key_hash}/budgets", {"budget_tokens": 5, "budget_window": "none"}),
        ("PUT", "/admin/keys/{key_hash}/budgets", {"tokens": 5}),
        ("POST", "/admin/keys/{key_hash}/rotate", {"expires_at": "soon"}),
        ("POST", "/admin/keys/{key_hash}/rotate", None),
        ("DELETE", "/admin/keys/{key_hash}", None),
        ("DELETE", "/admin/keys/{key_hash}", None),  # the rotated one: already revoked
    ):
        response = admin(a, method, template.format(key_hash=key_hash), body)
        validate_answer(doc, method, template, response)
        if method == "POST" and response.status_code == 201:
            key_hash = response.json()["key_hash"]
    for template in doc["paths"]:  # the admin key guards every admin route, as documented
        for method, operation in doc["paths"][template].items():
            if template.startswith("/admin/"):
                assert operation["security"] == [{"adminKey": []}]
                path = template.format(name="gold", key_hash=hash_key("x"), batch_id="batch_x")
                response = admin(a, method.upper(), path, {} if method in ("put", "post") else None, SEED_KEY)
                assert response.status_code == 401
                validate_answer(doc, method, template, response)
