"""A disconnect storm: many streams cancelled at random points (before the first byte, mid-stream,
or not at all) against a real server process with real Redis tenancy. Afterwards the engine is
idle (no sequence running or waiting, every KV block free), no lease is held, and the server
answered every request exactly once."""

from __future__ import annotations

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

from tests.chaos.conftest import AUTH, answered, live_leases, start_replica, stats, wait_ready
from tests.chaos.helpers import chat_body
from tests.pool.conftest import PAID_KEY, TENANTS

NUM_REQUESTS = 48


def cancel_before_first_byte(port: int, body: dict) -> str:
    payload = json.dumps({**body, "stream": True}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {PAID_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + payload)
    return "left before the first byte"


def cancel_after(url: str, body: dict, num_events: int | None) -> str:
    """Read `num_events` data events, then leave (None: read to the end)."""
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as r,
    ):
        assert r.status_code == 200, r.read()
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if line == "data: [DONE]":
                    return "finished"
                if num_events is not None and seen >= num_events:
                    return "left mid-stream"
    raise AssertionError("the stream ended without [DONE]")


def test_disconnect_storm_leaves_nothing_behind(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    server = start_replica(
        "server", tmp_path, tiny_model_dir, "--tenants", str(tenants), "--redis-url", redis_url
    )
    observer = redis.Redis.from_url(redis_url)
    rng = random.Random(15)
    try:
        wait_ready([server])
        model = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
        before = answered(server.url)
        plans = [rng.choice([0, 1, 2, 5, 20, None]) for _ in range(NUM_REQUESTS)]
        lengths = [rng.randrange(1, 40) for _ in range(NUM_REQUESTS)]

        def one(i: int) -> str:
            body = chat_body(model, f"storm {i} " + "word " * lengths[i], 64)
            if plans[i] == 0:
                return cancel_before_first_byte(server.port, body)
            return cancel_after(server.url, body, plans[i])

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, range(NUM_REQUESTS)))
        assert "left mid-stream" in outcomes and "left before the first byte" in outcomes

        deadline = time.monotonic() + 20
        while True:
            s = stats(server)
            num_answered = answered(server.url) - before
            idle = (
                s["num_running"] == 0
                and s["num_waiting"] == 0
                and s["num_free_blocks"] == s["num_total_blocks"]
            )
            if idle and num_answered == NUM_REQUESTS and live_leases(observer, "acme") == 0:
                break
            assert time.monotonic() < deadline, (s, num_answered, live_leases(observer, "acme"))
            time.sleep(0.05)
        time.sleep(0.2)
        assert answered(server.url) - before == NUM_REQUESTS  # exactly once: none counted twice
    finally:
        observer.close()
        server.stop()
    assert "Traceback" not in server.log.read_text()
