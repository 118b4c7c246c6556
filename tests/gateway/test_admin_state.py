"""The admin routes issue 44 added for the console: every tenant's batches (list, inspect, cancel),
and the serving state (the in-process engines, the pool's replicas); each needs the admin key and
no Redis, and answers as the OpenAPI document says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.batches.store import StoredBatch
from gateway.cli import build_tenancy
from gateway.openapi.document import build_openapi
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import client_for
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import validate_answer

ADMIN_KEY = "bg-admin-state"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TENANTS = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 100000
requests_per_minute = 6000
max_concurrent_requests = 10
queue_deadline_seconds = 10

[tenants.acme]
plan = "paid"
keys = ["{hash_key("sk-acme")}"]

[tenants.globex]
plan = "paid"
keys = ["{hash_key("sk-globex")}"]
"""
DOC = build_openapi("fake-model")


def stored_batch(batch_id: str, created_at: int, status: str = "in_progress") -> dict[str, Any]:
    """A batch record as the Batch API writes one (its runner never started here)."""
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "model": None,
        "errors": None,
        "input_file_id": "file-x",
        "completion_window": "24h",
        "status": status,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created_at,
        "in_progress_at": created_at,
        "expires_at": created_at + 86400,
        "finalizing_at": None,
        "completed_at": created_at if status == "completed" else None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 3, "completed": 0, "failed": 0},
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        },
        "metadata": None,
    }


@pytest.fixture
async def tenanted(tmp_path: Path) -> Any:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = Settings(
        tenants=str(tenants), embedding_model="none", admin_key_hash=hash_key(ADMIN_KEY), internal_token="t"
    )
    app = create_app(settings, engine=FakeEngine(), tenancy=build_tenancy(settings), owns_tenancy=True)
    store = app.state.gateway.batches.store
    old = stored_batch("batch_acme_old", 1000, "completed")
    await store.put_batch(StoredBatch("acme", "key_a", old))
    await store.put_batch(StoredBatch("globex", "key_g", stored_batch("batch_globex", 2000)))
    await store.put_batch(StoredBatch("acme", "key_a", stored_batch("batch_acme_new", 3000)))
    async with client_for(app) as client:
        yield client


def _check(response: httpx.Response, method: str, template: str) -> Any:
    validate_answer(DOC, method, template, response)
    return response.json()


async def test_every_tenants_batches_newest_first_and_by_tenant_or_status(
    tenanted: httpx.AsyncClient,
) -> None:
    listed = _check(await tenanted.get("/admin/batches", headers=ADMIN), "get", "/admin/batches")
    assert [(b["id"], b["tenant"]) for b in listed["data"]] == [
        ("batch_acme_new", "acme"),
        ("batch_globex", "globex"),
        ("batch_acme_old", "acme"),
    ]
    assert listed["has_more"] is False
    one = (await tenanted.get("/admin/batches", params={"limit": 1}, headers=ADMIN)).json()
    assert [b["id"] for b in one["data"]] == ["batch_acme_new"] and one["has_more"] is True
    acme = (await tenanted.get("/admin/batches", params={"tenant": "acme"}, headers=ADMIN)).json()
    assert [b["id"] for b in acme["data"]] == ["batch_acme_new", "batch_acme_old"]
    done = (await tenanted.get("/admin/batches", params={"status": "completed"}, headers=ADMIN)).json()
    assert [b["id"] for b in done["data"]] == ["batch_acme_old"]
    nobody = await tenanted.get("/admin/batches", params={"tenant": "nobody"}, headers=ADMIN)
    assert nobody.status_code == 404
    assert (await tenanted.get("/admin/batches", params={"limit": 0}, headers=ADMIN)).status_code == 400


async def test_inspect_and_cancel_any_tenants_batch_as_its_tenant_would(
    tenanted: httpx.AsyncClient,
) -> None:
    got = _check(
        await tenanted.get("/admin/batches/batch_globex", headers=ADMIN), "get", "/admin/batches/{batch_id}"
    )
    assert (got["tenant"], got["status"]) == ("globex", "in_progress")
    cancelled = await tenanted.post("/admin/batches/batch_globex/cancel", headers=ADMIN)
    body = _check(cancelled, "post", "/admin/batches/{batch_id}/cancel")
    assert (body["tenant"], body["status"]) == ("globex", "cancelling")
    # The tenant's own API sees the admin's cancel; the other tenant's key finds no such batch.
    own = await tenanted.get("/v1/batches/batch_globex", headers={"authorization": "Bearer sk-globex"})
    assert own.json()["status"] == "cancelling"
    other = await tenanted.get("/v1/batches/batch_globex", headers={"authorization": "Bearer sk-acme"})
    assert other.status_code == 404
    final = await tenanted.post("/admin/batches/batch_acme_old/cancel", headers=ADMIN)
    assert final.status_code == 400 and final.json()["error"]["code"] == "batch_not_cancellable"
    assert (await tenanted.get("/admin/batches/batch_nope", headers=ADMIN)).status_code == 404
    narrowed = await tenanted.get("/admin/batches/batch_globex", params={"tenant": "acme"}, headers=ADMIN)
    assert narrowed.status_code == 404


async def test_the_engines_state_per_priority_class(tenanted: httpx.AsyncClient) -> None:
    body = _check(await tenanted.get("/admin/engines", headers=ADMIN), "get", "/admin/engines")
    [engine] = body["data"]
    assert (engine["model"], engine["status"], engine["detail"]) == ("fake-model", "ready", None)
    stats = engine["stats"]
    assert stats["running"] == {"paid": 0, "free": 0, "batch": 0} and stats["num_total_blocks"] == 64
    assert stats["kv_cache_usage"] == 0.0


async def test_the_replicas_state_of_a_pool(tmp_path: Path) -> None:
    settings = Settings(
        upstreams=("http://127.0.0.1:9",), embedding_model="none", admin_key_hash=hash_key(ADMIN_KEY)
    )
    async with client_for(create_app(settings)) as client:
        body = _check(await client.get("/admin/replicas", headers=ADMIN), "get", "/admin/replicas")
        assert [(r["url"], r["healthy"]) for r in body["data"]] == [("http://127.0.0.1:9", False)]
        assert (await client.get("/admin/engines", headers=ADMIN)).json()["data"] == []


@pytest.mark.parametrize(
    "path", ["/admin/batches", "/admin/batches/batch_globex", "/admin/engines", "/admin/replicas"]
)
async def test_a_tenant_key_is_no_admin_key(tenanted: httpx.AsyncClient, path: str) -> None:
    for headers in ({"authorization": "Bearer sk-acme"}, {}):
        response = await tenanted.get(path, headers=headers)
        assert response.status_code == 401, (path, headers)
        assert response.json()["error"]["code"] == "invalid_api_key"
    tenant_key = {"authorization": "Bearer sk-acme"}
    cancel = await tenanted.post("/admin/batches/batch_globex/cancel", headers=tenant_key)
    assert cancel.status_code == 401
    own = await tenanted.get("/v1/batches/batch_globex", headers={"authorization": "Bearer sk-globex"})
    assert own.json()["status"] == "in_progress"  # nothing was cancelled
