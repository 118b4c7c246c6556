"""The console's tests: a gateway with two tenants (acme on the paid plan, globex on the free one),
prices, and the admin key; with Redis (the admin API) or without (the embedded store)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette

from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.fakes import FakeEngine

ADMIN_KEY = "bg-console-admin"
KEYS = {"acme": "sk-acme-console", "globex": "sk-globex-console"}
TENANTS = f"""
[prices."fake-model"]
input = 1.0
output = 4.0

[plans.paid]
priority = "paid"
tokens_per_minute = 1000000
requests_per_minute = 6000
max_concurrent_requests = 20
queue_deadline_seconds = 10

[plans.free]
priority = "free"
tokens_per_minute = 100000
requests_per_minute = 600
max_concurrent_requests = 4
queue_deadline_seconds = 5
budget_usd = 5.0
budget_window = "monthly"

[tenants.acme]
plan = "paid"
keys = ["{hash_key(KEYS["acme"])}"]

[tenants.globex]
plan = "free"
keys = ["{hash_key(KEYS["globex"])}"]
"""


def console_app(tmp_path: Path, redis_url: str | None = None, **settings: Any) -> Starlette:
    """The gateway over a fake engine, its state in `tmp_path`; the admin API with `redis_url`."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    values: dict[str, Any] = {
        "tenants": str(tenants),
        "redis_url": redis_url,
        "storage_dir": str(tmp_path / "state"),
        "embedding_model": "none",
        "admin_key_hash": hash_key(ADMIN_KEY),
        "internal_token": "internal-console-tests",
        "keep_alive_s": 1.0,
        **settings,
    }
    config = Settings(**values)
    return create_app(config, engine=FakeEngine(), tenancy=build_tenancy(config), owns_tenancy=True)


def csrf_of(html: str) -> str:
    """The session's CSRF token, from any console page's forms."""
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found is not None, html[:500]
    return found.group(1)


async def log_in(client: httpx.AsyncClient, key: str = ADMIN_KEY) -> httpx.Response:
    return await client.post("/ui/login", data={"admin_key": key, "next": "/ui/tenants"})
