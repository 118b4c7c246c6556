"""Redis killed and restarted under load (with persistence, as production runs it): every accepted
request ends exactly once, and the leases of requests that ended during the outage are released
when Redis returns, by the retried settlements, long before their TTL; the usage ledger then holds
exactly what the responses reported, each settlement once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import redis

from tenancy.ledger import rows_of_hash
from tests.chaos.conftest import AUTH, answered, live_leases, metric, start_replica, wait_ready
from tests.chaos.helpers import chat_body, stream_chat
from tests.conftest_redis import RedisProcess
from tests.pool.conftest import TENANTS


def test_redis_killed_and_restarted_under_load(
    tmp_path: Path, tiny_model_dir: Path, persistent_redis_process: RedisProcess
) -> None:
    redis_process = persistent_redis_process
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    server = start_replica(
        "server", tmp_path, tiny_model_dir, "--tenants", str(tenants), "--redis-url", redis_process.url
    )
    observer = redis.Redis.from_url(redis_process.url, socket_timeout=2)
    statuses: list[int] = []
    reported: list[dict[str, int]] = []
    stop_load = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            i = 0
            while not stop_load.is_set():
                r = http.post("/v1/chat/completions", json=chat_body(model, f"load {i}", 8), headers=AUTH)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    reported.append(r.json()["usage"])
                i += 1

    try:
        wait_ready([server])
        model = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
        assert metric(server.url, "batchgate_redis_up") == 1
        before = answered(server.url)
        loaders = [threading.Thread(target=load) for _ in range(2)]
        for t in loaders:
            t.start()
        # Streams in flight when Redis dies: they finish during the outage and cannot settle then.
        long = [
            {**chat_body(model, f"long {i}", 300), "stream_options": {"include_usage": True}}
            for i in range(4)
        ]
        streams = [stream_chat(server.url, body, AUTH) for body in long]
        for s in streams:
            assert s.first_event.wait(60)

        redis_process.stop()
        deadline = time.monotonic() + 10
        while metric(server.url, "batchgate_redis_up") != 0:
            assert time.monotonic() < deadline, "batchgate_redis_up did not go to 0"
            time.sleep(0.1)
        for s in streams:
            assert s.done.wait(60)
        time.sleep(0.5)  # more load refused while Redis is away
        redis_process.start()  # same port; the append-only file brings the leases back
        returned = time.monotonic()
        time.sleep(0.5)  # and load admitted again
        stop_load.set()
        for t in loaders:
            t.join(timeout=60)

        # Every stream ended once, normally: the outage only touched admission and settlement.
        for s in streams:
            assert s.error is None and s.status == 200 and s.ended_with_done and not s.error_events
        assert set(statuses) <= {200, 503}, statuses
        assert 503 in statuses and statuses[-1] == 200  # refused in the outage, served after it
        deadline = returned + 5.0
        while live_leases(observer, "acme") != 0:  # the lease TTL is 60 s: only the retry helps
            assert time.monotonic() < deadline, "leases still held 5 s after Redis returned"
            time.sleep(0.05)
        assert metric(server.url, "batchgate_redis_up") == 1
        assert answered(server.url) - before == len(statuses) + len(
            streams
        )  # each request answered exactly once
        # The ledger: exactly what the responses reported, the retried settlements included, once.
        reported += [[p for p in s.payloads if p.get("usage")][-1]["usage"] for s in streams]
        rows = [
            row
            for name in observer.scan_iter(match="{tenant:acme}:ledger:*")
            if not name.endswith(b":hours")
            for row in rows_of_hash("acme", int(name.rsplit(b":", 1)[1]), observer.hgetall(name))
        ]
        assert sum(r.requests for r in rows) == len(reported)
        assert sum(r.input for r in rows) == sum(u["prompt_tokens"] for u in reported)
        assert sum(r.output for r in rows) == sum(u["completion_tokens"] for u in reported)
    finally:
        stop_load.set()
        observer.close()
        server.stop()
