"""The gateway over the real `tenancy.Tenancy` (in-memory limiter): keys, priorities, 429s, settling."""

from __future__ import annotations

from pathlib import Path

import pytest

import tenancy
from engine.types import Priority
from tests.gateway.conftest import AppFactory, client_for
from tests.gateway.fakes import FakeEngine

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
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
    return path


async def test_real_tenancy(make_app: AppFactory, fake_engine: FakeEngine, tenants_file: Path) -> None:
    t = tenancy.Tenancy.from_settings(str(tenants_file), None)
    async with client_for(make_app(tenancy=t)) as c:
        r = await c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and "sk-wrong" not in r.text

        auth = {"Authorization": "Bearer sk-acme"}
        r = await c.post("/v1/chat/completions", json=BODY, headers=auth)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        (request,) = fake_engine.submitted
        assert (request.priority, request.fairness_key, request.queue_deadline_s) == (
            Priority.FREE,
            "acme",
            5.0,
        )

        r = await c.post("/v1/chat/completions", json={**BODY, "stream": True}, headers=auth)
        assert r.status_code == 200

        r = await c.post("/v1/chat/completions", json=BODY, headers=auth)  # the third in a minute
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
        assert len(fake_engine.submitted) == 2

        usage = await t.usage()
        assert usage["acme"].num_requests == 2
        assert usage["acme"].completion_tokens == 8  # 4 + 4, settled after each response ended
    await t.aclose()
