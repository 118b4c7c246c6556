"""The Batch API's record stores, one contract: SQLite (one gateway) and Redis (a pool; a real
redis-server). A line is journaled once and counted once; lists are in insertion order and page
by id; another tenant's ids are not there; the runner lease is one owner's at a time, and free
again once it lapses or is released."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from gateway.batches.redis_store import RedisBatchStore
from gateway.batches.store import BatchStore, LineResult, SQLiteBatchStore, StoredBatch


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[[], BatchStore]]:
    if request.param == "sqlite":
        yield lambda: SQLiteBatchStore(None)
    else:
        url = request.getfixturevalue("redis_url")
        yield lambda: RedisBatchStore(url)


def batch(batch_id: str, status: str = "in_progress", created_at: int = 100) -> dict[str, object]:
    return {"id": batch_id, "status": status, "created_at": created_at, "endpoint": "/v1/chat/completions"}


def test_the_contract(make_store: Callable[[], BatchStore]) -> None:
    async def run() -> None:
        store = make_store()
        # Files: insert or replace, in insertion order, per tenant, paged by id.
        for i in range(3):
            body = {"id": f"file-{i}", "bytes": 10 + i, "created_at": 100, "purpose": "batch"}
            await store.put_file("acme", body)
        await store.put_file(
            "acme", {"id": "file-1", "bytes": 50, "created_at": 100, "purpose": "batch_output"}
        )
        assert (await store.get_file("acme", "file-1") or {})["bytes"] == 50
        assert await store.get_file("other", "file-1") is None
        assert await store.file_usage("acme") == (3, 10 + 50 + 12)
        rows = await store.list_files("acme", purpose=None, after=None, limit=10, ascending=True)
        assert [r["id"] for r in rows] == ["file-0", "file-1", "file-2"]
        rows = await store.list_files("acme", purpose=None, after="file-2", limit=1, ascending=False)
        assert [r["id"] for r in rows] == ["file-1"]
        rows = await store.list_files("acme", purpose="batch", after=None, limit=10, ascending=True)
        assert [r["id"] for r in rows] == ["file-0", "file-2"]
        assert await store.delete_file("acme", "file-0") and not await store.delete_file("acme", "file-0")
        # Batches: newest first; the unfinished ones across tenants, oldest first.
        await store.put_batch(StoredBatch("acme", "key_a", batch("batch_1", created_at=101)))
        await store.put_batch(StoredBatch("zed", "key_z", batch("batch_2", created_at=100)))
        await store.put_batch(StoredBatch("acme", "key_a", batch("batch_3", "completed", 102)))
        assert [b["id"] for b in await store.list_batches("acme", after=None, limit=10)] == [
            "batch_3",
            "batch_1",
        ]
        assert [b["id"] for b in await store.list_batches("acme", after="batch_3", limit=10)] == ["batch_1"]
        assert [(b.tenant, b.body["id"]) for b in await store.unfinished()] == [
            ("zed", "batch_2"),
            ("acme", "batch_1"),
        ]
        await store.put_batch(StoredBatch("zed", "key_z", batch("batch_2", "cancelled")))
        assert [b.body["id"] for b in await store.unfinished()] == ["batch_1"]
        stored = await store.get_batch("acme", "batch_1")
        assert (
            stored is not None
            and stored.key_id == "key_a"
            and await store.get_batch("zed", "batch_1") is None
        )
        # The journal: once per custom_id, counted with it, read in input order.
        second = LineResult("b", 2, True, b'{"custom_id": "b"}', 5, 1, 0)
        first = LineResult("a", 1, False, b'{"custom_id": "a"}', 7, 2, 3)
        assert await store.record("acme", "batch_1", second)
        assert await store.record("acme", "batch_1", first)
        assert not await store.record("acme", "batch_1", LineResult("a", 1, True, b"again", 99, 0, 99))
        assert await store.results("acme", "batch_1") == [first, second]
        assert await store.tally("acme", "batch_1") == (2, 1, 12, 3, 3)
        assert await store.tally("acme", "batch_x") == (0, 0, 0, 0, 0)
        # Cancel marks.
        assert not await store.cancel_marked("acme", "batch_1")
        await store.mark_cancel("acme", "batch_1")
        assert await store.cancel_marked("acme", "batch_1")
        await store.aclose()

    asyncio.run(run())


def test_the_redis_lease_is_one_owners_until_it_lapses_or_is_released(redis_url: str) -> None:
    async def run() -> None:
        store = RedisBatchStore(redis_url)
        assert await store.claim("acme", "batch_1", "gw-a", 0.3)
        assert await store.claim("acme", "batch_1", "gw-a", 0.3)  # a renewal
        assert not await store.claim("acme", "batch_1", "gw-b", 0.3)
        assert 0 < await store.lease_left("acme", "batch_1") <= 0.3
        await store.release("acme", "batch_1", "gw-b")  # not its lease: nothing happens
        assert not await store.claim("acme", "batch_1", "gw-b", 0.3)
        deadline = time.monotonic() + 5
        while await store.lease_left("acme", "batch_1") > 0:  # Redis's own clock lapses it
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await store.claim("acme", "batch_1", "gw-b", 30)
        assert not await store.claim("acme", "batch_1", "gw-a", 30)
        await store.release("acme", "batch_1", "gw-b")
        assert await store.lease_left("acme", "batch_1") == 0
        assert await store.claim("acme", "batch_1", "gw-a", 30)
        await store.aclose()

    asyncio.run(run())


def test_the_sqlite_lease_is_always_the_single_gateways() -> None:
    async def run() -> None:
        store = SQLiteBatchStore(None)
        assert not store.shared
        assert await store.claim("acme", "batch_1", "gw-a", 1) and await store.claim(
            "acme", "batch_1", "gw-b", 1
        )
        assert await store.lease_left("acme", "batch_1") == 0
        await store.aclose()

    asyncio.run(run())
