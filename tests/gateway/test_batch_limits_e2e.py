"""The Batch API's own limits, end to end: the official openai SDK over real HTTP (uvicorn), the real
engine (tiny model), a real redis-server for the limiter, batches in the storage directory.

- A running batch's lines are admitted in the tenant's batch lane: while more of them are in flight
  than the plan's `max_concurrent_requests`, the tenant still gets its whole interactive concurrency
  and requests per minute, and the lines are still billed (the ledger's batch rows).
- `batch_enqueued_tokens` (OpenAI's batch queue limit): a batch that would take the tenant's
  unfinished batches over it fails validation with `token_limit_exceeded`, as OpenAI's does.
- The gateway's own caps: `--batch-max-running` batches at once (the next waits, validating) and
  `--batch-max-in-flight` lines of all of them.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types import Batch

from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tenancy.keyspace import leases_key
from tenancy.tokens import TokenCounter
from tests.gateway.conftest import LiveServer, tiny_async_engine

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Weather?"}]
LINE_TOKENS = TokenCounter().count_messages(MESSAGES)  # as the gateway's tenancy estimates them
TENANTS = """
[plans.team]
priority = "paid"
tokens_per_minute = 100000
requests_per_minute = 4
max_concurrent_requests = 2
queue_deadline_seconds = 30
batch_max_concurrent_lines = 6

[plans.queued]
priority = "paid"
tokens_per_minute = 100000
requests_per_minute = 1000
max_concurrent_requests = 10
queue_deadline_seconds = 30
batch_max_concurrent_lines = 2
batch_enqueued_tokens = {enqueued}

[tenants.lanes]
plan = "team"
keys = ["{lanes}"]

[tenants.queue]
plan = "queued"
keys = ["{queue}"]
"""
QUEUE_LIMIT = 50 * LINE_TOKENS  # a 40-line batch fits alone, not beside another of 20


def serve(settings: Settings, model_dir: Path) -> Iterator[LiveServer]:
    engine = tiny_async_engine(model_dir, MODEL)
    tenancy = build_tenancy(settings)
    live = LiveServer(create_app(settings, engine=engine, tenancy=tenancy, owns_tenancy=tenancy is not None))
    try:
        yield live
    finally:
        live.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    workdir = tmp_path_factory.mktemp("batch-limits")
    tenants = TENANTS.format(enqueued=QUEUE_LIMIT, lanes=hash_key("sk-lanes"), queue=hash_key("sk-queue"))
    (workdir / "tenants.toml").write_text(tenants)
    settings = Settings(
        tenants=str(workdir / "tenants.toml"),
        redis_url=redis_server,
        storage_dir=str(workdir / "storage"),
        keep_alive_s=1.0,
        embedding_model="none",
    )
    yield from serve(settings, tiny_model_dir)


def sdk(server: LiveServer, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key or "unused", max_retries=0)


def create(client: openai.OpenAI, num_lines: int, max_tokens: int, prefix: str = "l") -> Batch:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}
    lines = [
        {"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(num_lines)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait(client: openai.OpenAI, batch_id: str, until: Any, what: str, timeout_s: float = 60.0) -> Batch:
    deadline = time.monotonic() + timeout_s
    while not until(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"{what}: batch still {batch.status} after {timeout_s}s"
        time.sleep(0.02)
    return batch


def ended(batch: Batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def test_a_running_batch_leaves_the_tenant_its_whole_interactive_limits(
    server: LiveServer, redis_server: str
) -> None:
    client = sdk(server, "sk-lanes")
    batch = create(client, 36, max_tokens=96)  # 6 rounds of 6 lines: seconds of work
    observer = redis.Redis.from_url(redis_server)
    deadline = time.monotonic() + 30
    while observer.zcard(leases_key("lanes", batch=True)) < 3:  # more lines than the 2 requests at once
        assert time.monotonic() < deadline, "the batch's lines never reached 3 in flight"
        time.sleep(0.01)
    streams = [
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=200,
            stream=True,  # type: ignore[arg-type]
        )
        for _ in range(2)
    ]
    assert all(next(iter(s)).choices for s in streams)  # both admitted: the whole concurrency
    for stream in streams:
        stream.close()
    while observer.zcard(leases_key("lanes")) > 0:  # the closed streams' leases are released
        assert time.monotonic() < deadline, "the streams' leases were never released"
        time.sleep(0.01)
    # The upload and the batch's create took requests 1 and 2 of the minute's 4 (every route that
    # creates state costs a request, issue 43), the streams 3 and 4.
    with pytest.raises(openai.RateLimitError, match="requests per minute"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.request_counts is not None
    assert running.request_counts.completed < 36  # all of that while the batch ran
    done = wait(client, batch.id, ended, "the batch")
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (36, 0)
    usage = httpx.get(
        server.base_url + "/v1/usage",
        params={"start_time": int(time.time()) - 3600, "group_by": "batch"},
        headers={"authorization": "Bearer sk-lanes"},
    ).json()
    billed = [r for bucket in usage["data"] for r in bucket["results"] if r.get("batch")]
    assert sum(r["num_model_requests"] for r in billed) == 36
    assert sum(r["output_tokens"] for r in billed) == 36 * 96


def test_a_batch_over_the_enqueued_token_limit_fails_with_token_limit_exceeded(server: LiveServer) -> None:
    client = sdk(server, "sk-queue")
    first = create(client, 40, max_tokens=32, prefix="a")  # 40 lines at 2 at once: seconds of work
    wait(client, first.id, lambda b: b.status == "in_progress", "the first batch")
    second = wait(client, create(client, 20, max_tokens=1, prefix="b").id, ended, "the second batch")
    assert second.status == "failed" and second.errors is not None and second.errors.data
    error = second.errors.data[0]
    assert (error.code, error.line, error.param) == ("token_limit_exceeded", None, None)
    assert error.message is not None and f"Limit: {QUEUE_LIMIT:,} enqueued tokens" in error.message
    assert f"this batch has {20 * LINE_TOKENS:,}" in error.message
    assert client.batches.retrieve(first.id).status == "in_progress"  # the first one is untouched
    client.batches.cancel(first.id)
    assert wait(client, first.id, ended, "cancelling the first").status == "cancelled"
    third = wait(client, create(client, 20, max_tokens=1, prefix="c").id, ended, "the third batch")
    assert third.status == "completed"  # the queue is free again once the first one ended


def test_the_gateway_runs_at_most_its_batches_and_lines_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = Settings(
        storage_dir=str(tmp_path / "storage"),
        keep_alive_s=1.0,
        embedding_model="none",
        batch_max_running=1,
        batch_max_in_flight=2,
    )
    for live in serve(settings, tiny_model_dir):
        client = sdk(live)
        first = create(client, 10, max_tokens=32, prefix="x")
        second = create(client, 4, max_tokens=4, prefix="y")
        most = 0
        deadline = time.monotonic() + 60
        while True:
            waiting = client.batches.retrieve(second.id).status
            metrics = httpx.get(live.base_url + "/metrics").text
            if ended(done := client.batches.retrieve(first.id)):
                break
            assert waiting == "validating"  # read before the first had ended: it waits for a slot
            assert time.monotonic() < deadline, "the first batch did not end"
            in_flight = next(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("batchgate_batch_lines_in_flight ")
            )
            most = max(most, int(in_flight))
        assert done.status == "completed" and most <= 2
        after = wait(client, second.id, ended, "the second batch")
        assert after.status == "completed" and after.in_progress_at is not None
        assert done.completed_at is not None and after.in_progress_at >= done.completed_at
