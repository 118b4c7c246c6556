"""The response stores: SQLite (bounded, least recently used out, kept across a restart) and Redis
(per-tenant hash-tagged keys with a TTL, a per-tenant bound), both tenant-scoped, behind one
interface; and the app's choice between them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.responses.redis_store import RedisStore
from gateway.responses.store import SQLITE_FILE, ResponseStore, SQLiteStore, StoredResponse


def record(response_id: str, **extra: Any) -> StoredResponse:
    return StoredResponse(
        {"id": response_id, "object": "response", "output": [{"type": "message", "id": f"m-{response_id}"}]},
        [{"type": "message", "role": "user", "id": f"in-{response_id}", "content": []}],
        [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}', **extra}],
    )


async def put(store: ResponseStore, tenant: str, r: StoredResponse) -> None:
    await store.put(tenant, r.response_id, r.dumps())


async def get(store: ResponseStore, tenant: str, response_id: str) -> StoredResponse | None:
    raw = await store.get(tenant, response_id)
    return None if raw is None else StoredResponse.loads(raw)


async def _roundtrip_and_scope(store: ResponseStore) -> None:
    await put(store, "acme", record("resp_1", namespace="ns"))
    got = await get(store, "acme", "resp_1")
    assert got == record("resp_1", namespace="ns")  # items exactly as stored
    assert got is not None and [i["type"] for i in got.conversation()] == [
        "function_call",
        "message",
        "message",
    ]
    assert await get(store, "umbrella", "resp_1") is None  # another tenant's id is not there
    assert not await store.delete("umbrella", "resp_1")
    assert await store.delete("acme", "resp_1")
    assert await get(store, "acme", "resp_1") is None


async def test_sqlite_store_is_scoped_bounded_and_least_recently_used_out(tmp_path: Path) -> None:
    evicted: list[int] = []
    store = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=3, on_evict=evicted.append)
    await _roundtrip_and_scope(store)
    for i in range(3):
        await put(store, "acme", record(f"resp_{i}"))
    assert await get(store, "acme", "resp_0") is not None  # used: now the most recent
    await put(store, "umbrella", record("resp_3"))  # the bound is each tenant's: nothing of acme's goes
    assert evicted == [] and store.count() == 4 and await store.num_stored("acme") == 3
    await put(store, "acme", record("resp_4"))
    assert evicted == [1] and await store.num_stored("acme") == 3
    assert await get(store, "acme", "resp_1") is None  # the least recently used went
    assert await get(store, "acme", "resp_0") is not None
    await store.aclose()
    again = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=3)  # a restart loses nothing
    assert await get(again, "umbrella", "resp_3") == record("resp_3")
    await again.aclose()


async def test_sqlite_store_in_memory_stays_within_its_bound() -> None:
    evicted: list[int] = []
    store = SQLiteStore(None, max_num_responses=50, on_evict=evicted.append)
    for i in range(500):
        await put(store, "acme", record(f"resp_{i}"))
    assert store.count() == 50 and sum(evicted) == 450
    assert await get(store, "acme", "resp_499") is not None and await get(store, "acme", "resp_0") is None
    await store.aclose()


async def test_redis_store_keys_are_hash_tagged_with_a_ttl_and_a_per_tenant_bound(redis_url: str) -> None:
    evicted: list[int] = []
    store = RedisStore(redis_url, ttl_s=600, max_num_responses=2, on_evict=evicted.append)
    await _roundtrip_and_scope(store)
    for i in range(3):
        await put(store, "acme", record(f"resp_{i}"))
    await put(store, "umbrella", record("resp_9"))  # its own bound
    assert evicted == [1]
    assert await get(store, "acme", "resp_0") is None and await get(store, "acme", "resp_2") is not None
    assert await get(store, "umbrella", "resp_9") is not None
    client = redis.Redis.from_url(redis_url)
    try:
        assert 0 < client.ttl("{tenant:acme}:stored:resp_2") <= 600
        assert client.zcard("{tenant:acme}:stored") == 2
        assert not client.exists("{tenant:acme}:stored:resp_0")
    finally:
        client.close()
    await store.aclose()


@pytest.mark.parametrize("bad", [0, -1])
def test_a_store_needs_a_positive_bound(bad: int) -> None:
    with pytest.raises(ValueError, match="max_num_responses"):
        SQLiteStore(None, max_num_responses=bad)


async def test_the_app_keeps_responses_in_the_storage_dir_and_counts_evictions(
    make_app: Any, tmp_path: Path
) -> None:
    from tests.gateway.conftest import client_for

    app = make_app(storage_dir=str(tmp_path / "state"), responses_max_stored=1)
    async with client_for(app) as client:
        ids = []
        for _ in range(3):
            r = await client.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 404
        assert (await client.get(f"/v1/responses/{ids[2]}")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert "batchgate_response_store_evictions_total 2.0" in metrics
    assert (tmp_path / "state" / SQLITE_FILE).exists()


async def test_the_servers_store_keeps_its_bound_and_counts_evictions(make_app: Any, tmp_path: Path) -> None:
    """Through the app (--storage-dir, --responses-max-stored): past the bound the least recently
    used responses go, each counted in the eviction metric, and a continuation from one is a 404."""
    from tests.gateway.conftest import client_for

    async with client_for(make_app(storage_dir=str(tmp_path), responses_max_stored=3)) as client:
        ids = []
        for i in range(5):
            r = await client.post("/v1/responses", json={"model": "fake-model", "input": f"turn {i}"})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        assert [(await client.get(f"/v1/responses/{i}")).status_code for i in ids] == [404] * 2 + [200] * 3
        metrics = (await client.get("/metrics")).text
        assert "batchgate_response_store_evictions_total 2.0" in metrics, metrics
        r = await client.post(
            "/v1/responses", json={"model": "fake-model", "input": "x", "previous_response_id": ids[0]}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=3).count() == 3


async def test_sqlite_reads_see_writes_at_once_and_their_recency_outlives_a_clean_close(
    tmp_path: Path,
) -> None:
    """Reads run on a connection of their own, and their use is written with the next write or
    at close: a response read before a restart is still the more recently used after it."""
    store = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=2)
    for i in range(2):
        await put(store, "acme", record(f"resp_{i}"))
        assert await get(store, "acme", f"resp_{i}") == record(f"resp_{i}")  # the writer's, at once
    assert await get(store, "acme", "resp_0") is not None  # now the most recent, not yet written
    await store.aclose()
    again = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=2)
    await put(again, "acme", record("resp_2"))
    assert await get(again, "acme", "resp_1") is None and await get(again, "acme", "resp_0") is not None
    await again.aclose()


async def test_each_continuation_is_timed_in_the_lookup_histogram(make_app: Any) -> None:
    from tests.gateway.conftest import client_for

    async with client_for(make_app()) as client:
        first = await client.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
        conv = await client.post("/v1/conversations", json={})
        for ref in [{"previous_response_id": first.json()["id"]}, {"conversation": conv.json()["id"]}]:
            r = await client.post("/v1/responses", json={"model": "fake-model", "input": "on", **ref})
            assert r.status_code == 200, r.text
        metrics = (await client.get("/metrics")).text
    assert "batchgate_response_state_lookup_seconds_count 2.0" in metrics, metrics  # not the first turn
