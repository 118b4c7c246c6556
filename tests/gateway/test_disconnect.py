"""A client that leaves while its request is still queued (before the first byte) gives back its
queue place and its lease at once, not when its first token would have come. Real uvicorn, the
real engine (tiny model, one slot), the in-memory limiter, raw sockets as the clients."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import LiveServer

KEY = "sk-disconnect"
TENANTS = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 10000000
requests_per_minute = 6000
max_concurrent_requests = 8
queue_deadline_seconds = 3600  # the engine must queue, not refuse, the second request

[tenants.acme]
plan = "paid"
keys = ["{hash_key(KEY)}"]
"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tenants = tmp_path_factory.mktemp("disconnect") / "tenants.toml"
    tenants.write_text(TENANTS)
    # A keep-alive of 30 s: before the fix a queued stream was not watched for that long.
    settings = Settings(tenants=str(tenants), keep_alive_s=30.0)
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=4096,
            max_num_seqs=1,  # one slot: a second request waits in the queue
            kv_cache_memory_bytes=32 << 20,
        )
    )
    tenancy = build_tenancy(settings)
    live = LiveServer(create_app(settings, engine=engine, tenancy=tenancy, owns_tenancy=True))
    live.engine = engine
    live.tenancy = tenancy
    try:
        yield live
    finally:
        live.stop()
        engine.shutdown()


def open_request(port: int, max_tokens: int, stream: bool) -> socket.socket:
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + body)
    return sock


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_queued_request_whose_client_leaves_is_aborted_at_once(server: Any, stream: bool) -> None:
    engine, limiter = server.engine, server.tenancy.limiter
    running = open_request(server.port, 4000, stream=True)  # holds the only slot for seconds
    try:
        wait_for(lambda: engine.stats().num_running == 1, 30, "the first request did not start")
        queued = open_request(server.port, 8, stream=stream)
        wait_for(lambda: engine.stats().num_waiting == 1, 30, "the second request was not queued")
        assert limiter.num_leases("acme") == 2

        queued.close()
        left = time.monotonic()
        wait_for(lambda: engine.stats().num_waiting == 0, 2.0, "the queued request kept its place")
        wait_for(lambda: limiter.num_leases("acme") == 1, 2.0, "the queued request kept its lease")
        assert time.monotonic() - left < 2.0
        assert engine.stats().num_running == 1  # well before its first token would have come
    finally:
        running.close()
    wait_for(lambda: limiter.num_leases("acme") == 0, 10, "a lease was not released")
    stats = engine.stats()
    wait_for(
        lambda: engine.stats().num_running == 0 and engine.stats().num_free_blocks == stats.num_total_blocks,
        10,
        "the engine did not go idle",
    )
